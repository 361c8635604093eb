"""Weights of the device forward: dense matrices in a compute dtype, routed experts kept packed.

Legend: E routed experts, F expert hidden width, d = n_embd, rb = bytes of one packed row.

Sources are callables name -> (ggml type, uint8 bytes) so a GGUF file (ds4.gguf.ModelFile) and synthetic
weights built directly on the GPU (ds4.tools.synthetic.build_weights) load through the same code. Routed
experts stay in their ggml blocks ([E, rows, rb] uint8, never dequantized whole); every other matrix is
dequantized once to `dtype` (float32 for small models, so tests compare exactly; bfloat16 for Flash, for
tensor-core GEMMs). Small vectors (norms, HC, router, sinks, APE) stay float32.

Expert parallel (ds4.dist, N > 1 processes): each routed-expert stack keeps only this rank's contiguous
rows [lo, hi) of E (ds4.dist.expert_range), cut from the source's bytes before they are uploaded; a source
may also hand over just those rows already (synthetic weights built per shard).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from ds4 import dist
from ds4.config import ModelConfig
from ds4.layout import tensor_specs
from ds4.quant import GGMLType, dequantize, row_nbytes

RawSource = Callable[[str], tuple[GGMLType, torch.Tensor]]  # name -> (type, uint8 bytes, any shape)

# Dense tensors bigger than this many elements are kept in the compute dtype (matrices); smaller ones f32.
_SMALL = 1 << 22
# router, HC, compressors: selection-critical or fed to the CPU reference's pooling code unchanged
_KEEP_F32 = (
    "ffn_gate_inp.weight",
    "_fn.weight",
    "ape.weight",
    "compressor_kv.weight",
    "compressor_gate.weight",
)


@dataclass
class QLinear:
    """A quantized matrix [out, in] held twice: packed ggml blocks (ds4.kernels.packing) for the decode
    matvec, which reads the format's bytes, and a dense compute-dtype copy for prefill GEMMs."""

    dense: torch.Tensor
    packed: object  # ds4.kernels.packing.PackedWeight


@dataclass
class Packed:
    """One routed-expert tensor in ggml blocks: data [E, rows, rb] uint8; logical [E, rows, cols]."""

    qtype: GGMLType
    data: torch.Tensor
    rows: int
    cols: int


def gguf_source(mf) -> RawSource:
    """RawSource over an open ModelFile (bytes read from the mapping, not copied until uploaded)."""

    def get(name: str) -> tuple[GGMLType, torch.Tensor]:
        info = mf.info(name)
        with warnings.catch_warnings():  # read-only mapping: we only ever copy out of it
            warnings.filterwarnings("ignore", message=".*not writable.*")
            return GGMLType(info.qtype), torch.from_numpy(np.asarray(mf.raw(name)))

    return get


def dict_source(weights: dict[str, tuple[GGMLType, torch.Tensor]]) -> RawSource:
    """RawSource over build_weights' {name: (type, bytes)}; entries are dropped once taken (frees memory)."""

    def get(name: str) -> tuple[GGMLType, torch.Tensor]:
        qtype, raw = weights.pop(name)
        return GGMLType(qtype), raw

    return get


class WeightStore:
    """Load every tensor of cfg from `source` onto `device`, in the forms the forward uses."""

    def __init__(
        self, cfg: ModelConfig, source: RawSource, has: Callable[[str], bool], device, dtype, kernels: bool
    ):
        self.cfg, self.device, self.dtype, self.kernels = cfg, torch.device(device), dtype, kernels
        self.shapes = {s.name: s.shape for s in tensor_specs(cfg)}
        self.roles = {s.name: s.role for s in tensor_specs(cfg)}
        self.source, self.has = source, has

    def dense(self, name: str) -> torch.Tensor | QLinear:
        qtype, raw = self.source(name)
        shape = self.shapes[name]
        raw = raw.to(self.device).reshape(-1)
        if qtype == GGMLType.I32:
            return raw.view(torch.int32).reshape(shape).long()
        out = dequantize(raw, qtype, shape)  # f32 on device
        big = out.numel() > _SMALL and not name.endswith(_KEEP_F32)
        if big and self.dtype != torch.float32:
            out = out.to(self.dtype)
        if self.kernels and qtype == GGMLType.Q8_0 and name != "token_embd.weight":
            from ds4.kernels.matvec import rows_scales_in_use, rows_scales_pack
            from ds4.kernels.packing import pack

            w = pack(raw, qtype, shape)
            for scales in rows_scales_in_use():  # q8_rows's f32 scale copies, where switched on
                rows_scales_pack(w, scales)
            return QLinear(out.contiguous(), w)
        return out.contiguous()

    def packed(self, name: str):
        """Routed-expert stack: a ds4.kernels PackedWeight when the fused MoE kernels exist, else Packed."""
        qtype, raw = self.source(name)
        E, rows, cols = self.shapes[name]
        raw, E = expert_rows(name, raw, E, rows * row_nbytes(qtype, cols))
        if self.kernels and _has_moe_kernels():
            from ds4.kernels.moe_grouped import QUAD_STACKS
            from ds4.kernels.packing import pack, to_quad

            w = pack(raw.to(self.device).reshape(-1), qtype, (E, rows, cols))
            quad = QUAD_STACKS and qtype == GGMLType.IQ2_XXS  # the gate / up stacks (moe_grouped says why)
            return to_quad(w) if quad else w
        data = raw.to(self.device).reshape(E, rows, row_nbytes(qtype, cols))
        return Packed(qtype, data.contiguous(), rows, cols)


def expert_rows(name: str, raw: torch.Tensor, n_expert: int, expert_bytes: int) -> tuple[torch.Tensor, int]:
    """This rank's experts of a stack's bytes: (uint8 [n_local * expert_bytes], n_local). The source may give
    the whole stack (cut here, before any upload) or exactly this rank's rows."""
    lo, hi = dist.expert_range(n_expert)
    flat = raw.reshape(-1)
    if flat.numel() == (hi - lo) * expert_bytes:
        return flat, hi - lo
    if flat.numel() != n_expert * expert_bytes:
        raise ValueError(
            f"{name}: expected {n_expert} experts x {expert_bytes} bytes (or this rank's {hi - lo}), "
            f"got {flat.numel()} bytes"
        )
    return flat[lo * expert_bytes : hi * expert_bytes], hi - lo


def _has_moe_kernels() -> bool:
    try:
        import ds4.kernels.moe  # noqa: F401
    except ImportError:
        return False
    return True
