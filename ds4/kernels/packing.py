"""GPU-friendly repacking of ggml weights (model.md §3): scales split from quants, every array row-aligned.

A ggml tensor interleaves f16 scales with quants inside 34/66/84/144-byte blocks, so a row of blocks cannot be
read with aligned 16-byte vector loads. ``pack`` splits each format into separate arrays, one row per matrix
row (R = prod(shape[:-1]) rows; an expert stack [E, N, K] is R = E*N rows, expert e = rows e*N .. e*N+N-1):

qtype     key: dtype [shape]          content per row (nb = K/256 super-blocks)
F32/F16/BF16  w: native [R, K]        the values
Q8_0      qs: int8 [R, K]             x = d[k/32] * qs[k]
          d: f16 [R, K/32]
Q2_K      qs: u8 [R, nb*64]           the block's 64 quant bytes, unchanged (4 x 2-bit per byte)
          sc: u8 [R, nb*16]           the 16 scale bytes, unchanged (low nibble scale, high nibble min)
          dm: f16 [R, nb*2]           (d, dmin) per block
Q4_K      qs: u8 [R, nb*128]          the 128 quant bytes, unchanged (2 x 4-bit per byte)
          sc: u8 [R, nb*16]           8 six-bit scales then 8 six-bit mins, unpacked to a byte each
          dm: f16 [R, nb*2]           (d, dmin) per block
IQ2_XXS   qs: u8 [R, nb*32]           4 grid indices per 32-element sub-block (the a0 bytes)
          sg: int32 [R, nb*8]         a1 per sub-block: 4 x 7-bit sign indices, 4-bit scale << 28
          d: f16 [R, nb]              block scale
   (quad) qp: int64 [R, nb*8]         instead of qs + sg: the same 64 bytes a block reordered (quad_pack)

Total bytes equal the ggml size (Q4_K: +4 bytes per 144 for the unpacked 6-bit scales), so decode stays at
the format's bandwidth. Element order inside a block is ggml's (see the kernels for how quants map to k).
``unpack`` dequantizes the packed form with the exact float32 operation order of ds4.quant.dequantize, so
it is bit-identical to it (tested).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Any

import torch

from ds4.quant.dequant import as_byte_tensor, as_qtype, check_shape
from ds4.quant.tables import IQ2XXS_GRID, KSIGNS
from ds4.quant.types import BLOCK_GEOMETRY, GGMLType

PLAIN_DTYPES: dict[GGMLType, torch.dtype] = {
    GGMLType.F32: torch.float32,
    GGMLType.F16: torch.float16,
    GGMLType.BF16: torch.bfloat16,
}
QUANT_TYPES = (GGMLType.Q8_0, GGMLType.Q2_K, GGMLType.Q4_K, GGMLType.IQ2_XXS)
SUPPORTED = (*PLAIN_DTYPES, *QUANT_TYPES)

# Second copies of a Q8_0 matrix's block scales kept in its data beside "d" for the batched kernel q8_rows
# (matvec.rows_scales_pack: "d32" f32 [R, K/32], "d32t" f32 block-major [K/32, R]), by key: the axis of the
# matrix's rows in each (merging and slicing rows). A batch-1 decode step never reads them.
SCALE_COPY_ROW_DIM = {"d32": 0, "d32t": 1}

# Blocks repacked per step: bounds temporaries for multi-GB expert stacks.
_CHUNK_BLOCKS = 1 << 20


@dataclass
class PackedWeight:
    """One matrix [N, K] or a stack of experts [E, N, K] (K = row length), in the split layout above."""

    qtype: GGMLType
    shape: tuple[int, ...]
    data: dict[str, torch.Tensor] = field(repr=False)

    @property
    def K(self) -> int:  # noqa: N802 - the math name
        return self.shape[-1]

    @property
    def N(self) -> int:  # noqa: N802
        return self.shape[-2] if len(self.shape) >= 2 else 1

    @property
    def rows(self) -> int:
        return math.prod(self.shape[:-1])

    @property
    def quad(self) -> bool:
        """An IQ2_XXS stack in the quad layout (qp instead of qs + sg: quad_pack)."""
        return "qp" in self.data and "qs" not in self.data

    def split_data(self) -> dict[str, torch.Tensor]:
        """data in the split layout (a quad stack's qs + sg rebuilt: quad_unpack; else data itself)."""
        if not self.quad:
            return self.data
        qs, sg = quad_unpack(self.data["qp"])
        return {"qs": qs, "sg": sg, **{k: v for k, v in self.data.items() if k != "qp"}}

    @property
    def device(self) -> torch.device:
        return next(iter(self.data.values())).device

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.data.values())

    def view(self, *shape: int) -> PackedWeight:
        """The same arrays seen with other leading dims, e.g. a grouped [G*N, K] matrix as a [G, N, K] stack
        (for qmatvec_grouped); the row length must stay K."""
        if shape[-1] != self.K or math.prod(shape[:-1]) != self.rows:
            raise ValueError(
                f"PackedWeight.view: {shape} does not regroup the {self.rows} rows of {self.shape}"
            )
        return PackedWeight(self.qtype, tuple(shape), self.data)

    def to(self, device: torch.device | str) -> PackedWeight:
        moved = PackedWeight(self.qtype, self.shape, {k: v.to(device) for k, v in self.data.items()})
        if self.qtype == GGMLType.IQ2_XXS:
            iq2xxs_grid_i64(moved.device)  # as in pack: ready before any graph capture
        return moved


def pack(raw: Any, qtype: Any, shape: Any) -> PackedWeight:
    """Repack ggml bytes (uint8 tensor / numpy array / memmap, any device) of logical ``shape`` into the split
    layout, on raw's device. Raises ValueError for unsupported types, bad shapes or byte counts."""
    qt = as_qtype(qtype)
    if qt not in SUPPORTED:
        names = ", ".join(t.name for t in SUPPORTED)
        raise ValueError(f"pack: unsupported type {qt.name}; supported: {names}")
    dims = check_shape(qt, shape)
    data = as_byte_tensor(raw)
    block_elems, block_bytes = BLOCK_GEOMETRY[qt]
    numel = math.prod(dims)
    if data.numel() != numel // block_elems * block_bytes:
        raise ValueError(
            f"pack {qt.name} {dims}: expected {numel // block_elems * block_bytes} bytes, got {data.numel()}"
        )
    rows, k = math.prod(dims[:-1]), dims[-1]
    if qt in PLAIN_DTYPES:
        w = data.clone() if data.data_ptr() % 16 else data  # reinterpreting needs alignment
        return PackedWeight(qt, dims, {"w": w.view(PLAIN_DTYPES[qt]).reshape(rows, k)})
    if qt == GGMLType.IQ2_XXS:
        iq2xxs_grid_i64(data.device)  # build the kernels' table now: not during a CUDA-graph capture
    out = _alloc(qt, rows, k, data.device)
    blocks = data.reshape(-1, block_bytes)  # [n, B]
    for b0 in range(0, blocks.shape[0], _CHUNK_BLOCKS):
        blk = blocks[b0 : b0 + _CHUNK_BLOCKS]
        for key, val in _split_blocks(qt, blk).items():
            flat = out[key].view(-1, val.shape[1])  # [n_total, per-block width]
            flat[b0 : b0 + blk.shape[0]] = val
    return PackedWeight(qt, dims, out)


def _alloc(qt: GGMLType, rows: int, k: int, device: torch.device) -> dict[str, torch.Tensor]:
    nb = k // BLOCK_GEOMETRY[qt][0]
    u8, f16 = torch.uint8, torch.float16

    def e(n: int, dt: torch.dtype) -> torch.Tensor:
        return torch.empty(rows, n, dtype=dt, device=device)

    if qt == GGMLType.Q8_0:
        return {"qs": e(k, torch.int8), "d": e(nb, f16)}
    if qt == GGMLType.Q2_K:
        return {"qs": e(nb * 64, u8), "sc": e(nb * 16, u8), "dm": e(nb * 2, f16)}
    if qt == GGMLType.Q4_K:
        return {"qs": e(nb * 128, u8), "sc": e(nb * 16, u8), "dm": e(nb * 2, f16)}
    return {"qs": e(nb * 32, u8), "sg": e(nb * 8, torch.int32), "d": e(nb, f16)}


def _f16(b: torch.Tensor) -> torch.Tensor:
    """[n, 2m] bytes -> [n, m] f16 (little-endian)."""
    return b.contiguous().view(torch.float16)


def _split_blocks(qt: GGMLType, blk: torch.Tensor) -> dict[str, torch.Tensor]:
    """[n, B] raw blocks -> per-key [n, width] arrays (width = that array's share of one block)."""
    n = blk.shape[0]
    if qt == GGMLType.Q8_0:  # f16 d | int8 q[32]
        return {"qs": blk[:, 2:34].contiguous().view(torch.int8), "d": _f16(blk[:, 0:2])}
    if qt == GGMLType.Q2_K:  # u8 scales[16] | u8 qs[64] | f16 d | f16 dmin
        return {"qs": blk[:, 16:80], "sc": blk[:, 0:16], "dm": _f16(blk[:, 80:84])}
    if qt == GGMLType.Q4_K:  # f16 d | f16 dmin | u8 scales[12] | u8 qs[128]
        lo, mid, hi = blk[:, 4:8], blk[:, 8:12], blk[:, 12:16]  # [n, 4] each
        sc = torch.cat([lo & 63, (hi & 15) | ((lo >> 6) << 4), mid & 63, (hi >> 4) | ((mid >> 6) << 4)], 1)
        return {"qs": blk[:, 16:144], "sc": sc, "dm": _f16(blk[:, 0:4])}
    # IQ2_XXS: f16 d | 8 sub-blocks x (4 grid-index bytes a0, u32 a1)
    sub = blk[:, 2:66].reshape(n, 8, 8)
    return {
        "qs": sub[..., 0:4].reshape(n, 32),
        "sg": sub[..., 4:8].contiguous().view(torch.int32).reshape(n, 8),
        "d": _f16(blk[:, 0:2]),
    }


# ---------------------------------------------------------------------------------------------------------
# The quad layout of IQ2_XXS stacks, for the batched gate/up kernel's lanes (moe_grouped, GroupedConfig.
# quad_pack: lane t of a quad owns group t of all 8 sub-blocks, and loads just its 16 bytes). Written by hand:
# no library packs for this kernel's lanes. Per row and block, 4 pairs of int64 words, pair t:
#   word 0: byte s = the grid index of group t of sub-block s;
#   word 1: half h (bits 32 h ..) holds sub-block 4 h + i's 7-bit sign index of group t at bit 7 i (i < 4),
#           and in its top nibble the 4-bit scale of sub-block 2 t + h.


def quad_pack(qs: torch.Tensor, sg: torch.Tensor, rows: int = 1 << 16) -> torch.Tensor:
    """Split qs u8 [R, nb*32] + sg int32 [R, nb*8] -> qp int64 [R, nb*8], the same bytes, `rows` at a time."""
    R, nb = qs.shape[0], qs.shape[1] // 32
    out = torch.empty(R, nb, 4, 2, dtype=torch.int64, device=qs.device)
    t = torch.arange(4, device=qs.device)
    sh = 7 * t
    for r0 in range(0, R, rows):
        q = qs[r0 : r0 + rows].reshape(-1, nb, 8, 4)  # [r, nb, s, t] grid bytes
        out[r0 : r0 + rows, :, :, 0] = q.transpose(2, 3).contiguous().view(torch.int64)[..., 0]
        a = sg[r0 : r0 + rows].reshape(-1, nb, 8).to(torch.int64)  # [r, nb, s] sub-block words
        si = (a[:, :, None, :] >> sh[:, None]) & 127  # [r, nb, t, s]
        sc = (a >> 28) & 15  # [r, nb, s]
        lo = (si[..., :4] << sh).sum(-1) | (sc[:, :, 0::2] << 28)  # [r, nb, t]
        hi = (si[..., 4:] << sh).sum(-1) | (sc[:, :, 1::2] << 28)
        out[r0 : r0 + rows, :, :, 1] = lo | (hi << 32)
    return out.view(R, nb * 8)


def quad_unpack(qp: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """quad_pack's inverse: qp int64 [R, nb*8] -> (qs u8 [R, nb*32], sg int32 [R, nb*8])."""
    R, nb = qp.shape[0], qp.shape[1] // 8
    w = qp.view(R, nb, 4, 2)  # [r, nb, t, word]
    qs = w[..., 0].contiguous().view(torch.uint8).reshape(R, nb, 4, 8).transpose(2, 3)  # [r, nb, s, t]
    sh = 7 * torch.arange(4, device=qp.device)
    halves = torch.stack([w[..., 1] & 0xFFFFFFFF, w[..., 1] >> 32], -1)  # [r, nb, t, h]
    si = (halves[..., None] >> sh) & 127  # [r, nb, t, h, i]: sub-block 4 h + i
    si = si.reshape(R, nb, 4, 8)  # [r, nb, t, s]
    sc = (halves >> 28) & 15  # [r, nb, t, h]: sub-block 2 t + h
    sg = (si << sh[:, None]).sum(2) | (sc.reshape(R, nb, 8) << 28)  # [r, nb, s]
    sg = torch.where(sg >= 2**31, sg - 2**32, sg).to(torch.int32)
    return qs.reshape(R, nb * 32).contiguous(), sg.reshape(R, nb * 8)


def to_quad(w: PackedWeight) -> PackedWeight:
    """An IQ2_XXS weight in the quad layout (qp replaces qs + sg: no byte more); other data kept."""
    if w.qtype != GGMLType.IQ2_XXS:
        raise ValueError(f"to_quad: the quad layout is IQ2_XXS's, got {w.qtype.name}")
    if w.quad:
        return w
    qp = quad_pack(w.data["qs"], w.data["sg"])
    rest = {k: v for k, v in w.data.items() if k not in ("qs", "sg")}
    return PackedWeight(w.qtype, w.shape, {"qp": qp, **rest})


# ---------------------------------------------------------------------------------------------------------
# Reference decode of the packed form (bit-identical to ds4.quant.dequantize: same float32 op order)


@functools.cache
def iq2xxs_grid_i64(device: torch.device) -> torch.Tensor:
    """[256] int64: IQ2XXS_GRID words (8 magnitude bytes each, little-endian) for the Triton kernels."""
    return torch.tensor(IQ2XXS_GRID, dtype=torch.int64, device=device)


@functools.cache  # built once per device, before any graph capture (a host copy cannot be captured)
def iq2xxs_codes16(device: torch.device) -> torch.Tensor:
    """[256] int16: each IQ2XXS_GRID row as 2-bit magnitude codes (8 -> 0, 25 -> 1, 43 -> 2), element j at
    bits 2j: a 512-byte table whose rows the kernels expand to the magnitude bytes (moe._grid_words)."""
    word = (_grid_codes() << (2 * torch.arange(8))).sum(1)  # < 2^16
    return torch.where(word >= 2**15, word - 2**16, word).to(torch.int16).to(device)


def _grid_codes() -> torch.Tensor:
    """[256, 8] int64: the magnitude code (8 -> 0, 25 -> 1, 43 -> 2) of each element of each grid row."""
    mags = torch.tensor(IQ2XXS_GRID, dtype=torch.int64).view(torch.uint8).reshape(256, 8).long()
    return (mags > 8).long() + (mags > 25).long()


# The byte permutes' two source words of IQ2_XXS decoding (moe._prmt_words): the magnitudes 8, 25, 43
# (byte 3: 0) and their negations, so a selector nibble picks a signed magnitude
PRMT_POS = 0x002B1908
PRMT_NEG = 0x00D5E7F8


@functools.cache  # built once per device, before any graph capture (a host copy cannot be captured)
def iq2xxs_nibbles(device: torch.device) -> torch.Tensor:
    """[257] int32: each grid row's magnitude codes as nibbles (element j at bits 4j: moe._prmt_words),
    then the permutes' source word of the positive magnitudes (bytes 8, 25, 43, 0: PRMT_POS)."""
    word = (_grid_codes() << (4 * torch.arange(8))).sum(1)  # < 2^31: codes <= 2
    return torch.cat([word, torch.tensor([PRMT_POS])]).to(torch.int32).to(device)


@functools.cache  # built once per device, before any graph capture (a host copy cannot be captured)
def iq2_sign_nibbles(device: torch.device) -> torch.Tensor:
    """[128] int32: bit 4j + 2 set where sign pattern KSIGNS[s] negates element j (moe._prmt_words)."""
    bits = (torch.tensor(KSIGNS, dtype=torch.int64)[:, None] >> torch.arange(8)) & 1  # [128, 8]
    word = (bits << (4 * torch.arange(8) + 2)).sum(1)  # bit 30 at most
    return word.to(torch.int32).to(device)


@functools.cache
def _signed_grid(device: torch.device) -> torch.Tensor:
    """[256 * 128, 8] f32: grid row g with sign pattern KSIGNS[s] at row g*128 + s."""
    mags = torch.tensor(IQ2XXS_GRID, dtype=torch.int64).view(torch.uint8).reshape(256, 1, 8).float()
    bits = (torch.tensor(KSIGNS, dtype=torch.uint8).reshape(128, 1) >> torch.arange(8, dtype=torch.uint8)) & 1
    return (mags * (1.0 - 2.0 * bits.float())).reshape(256 * 128, 8).to(device)


def unpack(pw: PackedWeight) -> torch.Tensor:
    """float32 values of the packed weight, shape pw.shape (reference for the kernels)."""
    qt, d = pw.qtype, pw.split_data()
    if qt in PLAIN_DTYPES:
        return d["w"].float().reshape(pw.shape)
    n = pw.rows * pw.K // BLOCK_GEOMETRY[qt][0]  # blocks
    dev = pw.device
    if qt == GGMLType.Q8_0:
        out = d["qs"].reshape(n, 32).float() * d["d"].reshape(n, 1).float()
    elif qt in (GGMLType.Q2_K, GGMLType.Q4_K):
        dm = d["dm"].reshape(n, 2).float()
        sc = d["sc"].reshape(n, 16)
        if qt == GGMLType.Q2_K:  # (half, shift, 32 bytes) -> 16 groups of 16 in output order
            shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=dev).reshape(1, 1, 4, 1)
            q = ((d["qs"].reshape(n, 2, 1, 32) >> shifts) & 3).reshape(n, 16, 16)
            scale, mins = sc & 15, sc >> 4
        else:  # chunk c: low nibbles -> sub-block 2c, high -> 2c+1
            shifts = torch.tensor([0, 4], dtype=torch.uint8, device=dev).reshape(1, 1, 2, 1)
            q = ((d["qs"].reshape(n, 4, 1, 32) >> shifts) & 15).reshape(n, 8, 32)
            scale, mins = sc[:, :8], sc[:, 8:]
        dl = (dm[:, 0:1] * scale.float())[..., None]
        ml = (dm[:, 1:2] * mins.float())[..., None]
        out = dl * q.float() - ml
    else:  # IQ2_XXS
        sg = d["sg"].reshape(n, 8)
        db = d["d"].reshape(n, 1).float() * (0.5 + ((sg >> 28) & 15).float()) * 0.25  # [n, 8]
        shifts = torch.tensor([0, 7, 14, 21], dtype=torch.int32, device=dev)
        row = d["qs"].reshape(n, 8, 4).long() * 128 + ((sg[..., None] >> shifts) & 127)  # [n, 8, 4]
        vals = torch.index_select(_signed_grid(dev), 0, row.reshape(-1)).reshape(n, 8, 4, 8)
        out = db[..., None, None] * vals
    return out.reshape(pw.shape)


__all__ = [
    "PackedWeight",
    "SUPPORTED",
    "iq2xxs_grid_i64",
    "pack",
    "quad_pack",
    "quad_unpack",
    "to_quad",
    "unpack",
]
