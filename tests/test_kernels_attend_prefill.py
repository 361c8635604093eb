"""Prefill attention (ds4/kernels/attend_prefill.py) against an f64 per-query oracle and against the model's
own torch path, ds4.model.cuda.layer._sink_attention_chunk.

Tiny shapes run under Triton's interpreter (via test_kernels_interpreted.py on CPU machines); the cuda-marked
tests run Flash shapes compiled. Legend: T queries, H heads, D head dim, W window, N raw rows, C compressed
rows (plus P poison rows), k compressed rows listed per query.

Masking is made to fail loudly: invalid comp_idx entries point at poison rows whose values are ~1e3 (any leak
dominates the softmax), or hold out-of-range garbage indices (any read outside comp is an error on the GPU
and a wrong value here).

Tolerances. f32: exact products, only the order of f32 sums differs -> 1e-5 of max |o|. bf16: the kernel and
the oracle use the same bf16-rounded q and keys; the kernel also rounds the probabilities p to bf16 before
the p @ V dot (as the model's path does), which moves each p_j by at most 2^-8 p_j (the unit roundoff of
bf16's 8-bit significand), so |o - o_exact| <= 2^-8 sum_j p_j |v_j| <= 2^-8 max |v| per query: that bound
(+1 %) is the test. Against _sink_attention_chunk in bf16 (which also rounds the scores and both partial
outputs to bf16: a score s moves by up to 2^-8 |s|) the check is the looser 3e-2 of max |o|.
"""

from __future__ import annotations

import _kernel_env  # noqa: F401  (interpreter / GPU setup; skips this module in the plain CPU run)
import pytest
import torch
from _kernel_env import DEVICE

from ds4.kernels.attend_prefill import PrefillConfig, attend_prefill, attend_prefill_ref
from ds4.model.cuda.layer import _sink_attention_chunk

POISON = 1e3  # value of the rows invalid entries point at
N_POISON = 3  # poison rows, after the C real ones


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)  # inputs made on the CPU, then moved: same values everywhere


def _case(T: int, H: int, D: int, W: int, p0: int, mode: str, k: int, seed: int, ratio: int = 4) -> dict:
    """Random inputs of one chunk, one compressed row per `ratio` positions. mode: 'none' (no compressed
    rows), 'all' (every row, causal validity), 'topk' (k random entries per query, some invalid -> poison
    rows), 'garbage' (invalid -> out of range)."""
    g = _gen(seed)
    n_prev = min(p0, W - 1)
    raw_p0 = p0 - n_prev
    N = n_prev + T
    case = dict(
        q=torch.randn(T, H, D, generator=g) * 2,  # sharper than unit scores: masking errors show
        raw=torch.randn(N, D, generator=g),
        raw_p0=raw_p0,
        p0=p0,
        window=W,
        comp=None,
        comp_idx=None,
        comp_valid=None,
        sinks=torch.randn(H, generator=g),
        scale=D**-0.5,
    )
    C = (p0 + T) // ratio
    if mode == "none" or C == 0:
        return case
    counts = (p0 + torch.arange(T) + 1) // ratio  # [T] rows each query may see
    if mode == "all":
        idx = torch.arange(C).expand(T, C)  # a broadcast view, as _indexer_pick passes it
        valid = idx < counts[:, None]
        comp = torch.randn(C, D, generator=g)
    else:
        P = N_POISON
        comp = torch.cat([torch.randn(C, D, generator=g), torch.full((P, D), POISON)])
        idx = (torch.rand(T, k, generator=g) * counts[:, None].clamp_min(1)).long()  # [T, k] < counts
        valid = (torch.rand(T, k, generator=g) < 0.8) & (idx < counts[:, None])
        bad = torch.randint(C, C + P, (T, k), generator=g)
        if mode == "garbage":
            bad = torch.where(torch.rand(T, k, generator=g) < 0.5, -(1 << 40), 1 << 40) + bad
        idx = torch.where(valid, idx, bad)
    case.update(comp=comp, comp_idx=idx, comp_valid=valid)
    return case


def _to(case: dict, device: torch.device) -> dict:
    return {n: v.to(device) if isinstance(v, torch.Tensor) else v for n, v in case.items()}


def _oracle(case: dict, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(o [T, H, D] f64, max |v| over each query's visible keys [T]): one query at a time, exact softmax."""
    q = case["q"].to(dtype).double()
    raw = case["raw"].to(dtype).double()
    T, H, D = q.shape
    out = torch.zeros(T, H, D, dtype=torch.float64)
    vmax = torch.zeros(T, dtype=torch.float64)
    for t in range(T):
        pos = case["p0"] + t
        keys = [raw[i] for i in range(raw.shape[0]) if pos - case["window"] < case["raw_p0"] + i <= pos]
        if case["comp_idx"] is not None:
            comp = case["comp"].to(dtype).double()
            for c, ok in zip(case["comp_idx"][t].tolist(), case["comp_valid"][t].tolist(), strict=True):
                if ok:
                    keys.append(comp[c])
        K = torch.stack(keys)  # [n, D]
        s = torch.cat([q[t] @ K.T * case["scale"], case["sinks"].double()[:, None]], dim=1)  # [H, n + 1]
        out[t] = s.softmax(-1)[:, :-1] @ K
        vmax[t] = K.abs().max()
    return out, vmax


def _check(got: torch.Tensor, case: dict, dtype: torch.dtype) -> None:
    want, vmax = _oracle(case, dtype)
    got = got.cpu().double()
    assert got.shape == want.shape
    err = (got - want).abs().amax(dim=(1, 2))  # [T]
    if dtype == torch.float32:
        assert float(err.max() / want.abs().max()) < 1e-5
    else:
        bound = 2.0**-8 * vmax * 1.01 + 1e-6 * want.abs().max()
        assert bool((err <= bound).all()), f"bf16 error {(err / bound).max():.3f} x the bound"


def _model_path(case: dict, dtype: torch.dtype) -> torch.Tensor:
    """The model's current torch path (it gathers comp[comp_idx]: garbage indices must be made legal)."""
    c = dict(case)
    T = c["q"].shape[0]
    positions = c["p0"] + torch.arange(T, device=c["q"].device)
    if c["comp_idx"] is not None:
        c["comp_idx"] = c["comp_idx"].clamp(0, c["comp"].shape[0] - 1)
    args = (c["q"], c["raw"], c["raw_p0"], positions, c["window"], c["comp"], c["comp_idx"], c["comp_valid"])
    return _sink_attention_chunk(*args, c["sinks"], dtype)


def _run(case: dict, dtype: torch.dtype, fn=attend_prefill) -> torch.Tensor:
    c = _to(case, DEVICE)
    names = ("q", "raw", "raw_p0", "p0", "window", "comp", "comp_idx", "comp_valid", "sinks", "scale")
    return fn(*(c[n] for n in names), dtype=dtype)


# T, H, D, W, p0, mode, k: chunk shorter than the window, p0 0 / inside / past the window, odd sizes
TINY = [
    (5, 4, 64, 16, 0, "none", 0),
    (37, 8, 64, 16, 0, "topk", 6),
    (21, 5, 64, 16, 3, "all", 0),
    (9, 4, 64, 16, 40, "topk", 8),
    (33, 8, 64, 8, 100, "garbage", 5),
    (1, 4, 64, 16, 77, "all", 0),
    (19, 6, 48, 16, 20, "topk", 20),
    (11, 4, 128, 32, 50, "topk", 8),  # the tiny test model's attention shape
]


@pytest.mark.parametrize("T,H,D,W,p0,mode,k", TINY)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attend_prefill_vs_oracle(T, H, D, W, p0, mode, k, dtype) -> None:
    case = _case(T, H, D, W, p0, mode, k, seed=T * 7 + p0)
    _check(_run(case, dtype), case, dtype)


@pytest.mark.parametrize("bh,bn", [(16, 16), (32, 16)])
def test_other_tilings(bh: int, bn: int) -> None:
    """Several head blocks (H 20 over BH 16) or one masked one (BH 32), key blocks of 16 (tl.dot's smallest
    K on the GPU; the interpreter would accept 8, the sm_90 compile does not)."""
    cfg = PrefillConfig(bh=bh, bn=bn, warps=4, stages=1)
    case = _case(12, 20, 32, 16, 9, "garbage", 24, seed=5)
    for dtype in (torch.float32, torch.bfloat16):
        _check(_run(case, dtype, lambda *a, **kw: attend_prefill(*a, **kw, cfg=cfg)), case, dtype)


@pytest.mark.parametrize("T,H,D,W,p0,mode,k", TINY[:5])
def test_twin_vs_oracle(T, H, D, W, p0, mode, k) -> None:
    case = _case(T, H, D, W, p0, mode, k, seed=T * 7 + p0 + 1)
    for dtype in (torch.float32, torch.bfloat16):
        _check(_run(case, dtype, attend_prefill_ref), case, dtype)


@pytest.mark.parametrize("T,H,D,W,p0,mode,k", [c for c in TINY if c[5] != "garbage"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attend_prefill_vs_model_path(T, H, D, W, p0, mode, k, dtype) -> None:
    case = _to(_case(T, H, D, W, p0, mode, k, seed=T * 11 + p0), DEVICE)
    got, want = _run(case, dtype), _model_path(case, dtype)
    tol = 2e-6 if dtype == torch.float32 else 3e-2
    assert float((got - want).abs().max() / want.abs().max()) < tol


def test_bad_shapes_are_named() -> None:
    case = _case(4, 4, 64, 8, 0, "topk", 3, seed=1)
    case["sinks"] = torch.zeros(5)
    with pytest.raises(ValueError, match="sinks must be"):
        _run(case, torch.float32)
    case = _case(4, 4, 64, 8, 8, "topk", 3, seed=1)
    case["comp_valid"] = case["comp_valid"][:, :2]
    with pytest.raises(ValueError, match="comp_valid must be"):
        _run(case, torch.float32)


# ---------------------------------------------------------------------------------------------------------
# Flash shapes (compiled): H 64, D 512, W 128, k 512 (ratio-4 layers) or every row (ratio-128 layers).


def _flash_case(T: int, p0: int, mode: str, seed: int) -> dict:
    return _case(T, 64, 512, 128, p0, mode, 512, seed, ratio=128 if mode == "all" else 4)


def _rounded(case: dict, dtype: torch.dtype) -> dict:
    """The case with q, raw and comp rounded to dtype and back to f32 (the operands the kernel multiplies)."""
    return {
        n: v.to(dtype).float() if n in ("q", "raw", "comp") and v is not None else v for n, v in case.items()
    }


def _check_vs_twin(case: dict, mode: str, dtype: torch.dtype) -> None:
    """Against the twin in f32 on the rounded operands (p not rounded): the bound of the module docstring,
    with max |v| over all keys (poison rows left out); then against the model path."""
    got = _run(case, dtype)
    want = _run(_rounded(case, dtype), torch.float32, attend_prefill_ref)
    err = float((got - want).abs().max())
    if dtype == torch.float32:  # f32 sums over up to 640 keys x 512 dims in another order (H200: 1.7e-5)
        assert err / float(want.abs().max()) < 5e-5
    else:
        keys = [case["raw"]]
        if case["comp"] is not None:
            keys.append(case["comp"][: case["comp"].shape[0] - (0 if mode == "all" else N_POISON)])
        vmax = max(float(k.to(dtype).float().abs().max()) for k in keys)
        assert err <= 2.0**-8 * vmax * 1.01 + 1e-5 * float(want.abs().max())
    want = _model_path(case, dtype)
    tol = 5e-5 if dtype == torch.float32 else 3e-2  # f32: the bound above (H200: 1.2e-5 at T = 4096)
    assert float((got - want).abs().max() / want.abs().max()) < tol


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_twin_check_on_tiny_shapes(dtype: torch.dtype) -> None:
    """The Flash-shape check below, on a tiny case (so that it runs here too)."""
    _check_vs_twin(_to(_case(17, 4, 64, 16, 30, "topk", 8, seed=3), DEVICE), "topk", dtype)


@pytest.mark.cuda
@pytest.mark.parametrize("T,p0,mode", [(4096, 0, "topk"), (1000, 4096, "topk"), (4096, 4096, "all")])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_flash_shapes(T: int, p0: int, mode: str, dtype: torch.dtype) -> None:
    _check_vs_twin(_to(_flash_case(T, p0, mode, seed=T + p0), DEVICE), mode, dtype)
