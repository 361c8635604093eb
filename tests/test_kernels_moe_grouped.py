"""Routed experts grouped by expert (ds4.kernels.moe_grouped) vs the int8 pair path's torch twin.

Oracles: ref.moe_gate_up_q8k / ref.moe_down_q8k (the twins of moe.py's int8 kernels: the same Q8_K
activation planes and integer dots, summed as exact integers per block), a plain Python grouping of the
pairs, and at Flash widths (GPU) moe.moe_gate_up / moe_down with MoeConfig(int8=True). The grouped kernels
apply the same f32 operations per pair, so the tolerance is the int8 kernels' own against their twin
(F32_TOL, max abs error / max |reference|). Expert ids repeat within and across rows so runs are longer
than one pair and longer than a program's pair tile (split over programs); ids outside [0, E) must add
nothing (expert parallel: other ranks' experts).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import triton
import triton.language as tl
from _kernel_env import CUDA, DEVICE, generator, rel_err

from ds4.kernels import moe, moe_grouped, ref
from ds4.kernels.packing import iq2_sign_nibbles, pack, to_quad
from ds4.quant import GGMLType, random_blocks

F32_TOL = 1e-5
CHAIN_TOL = 1e-4  # gate/up then down: a last-bit difference in mid can move one Q8_K rounding of mid
WIDE = 16 if CUDA else 256  # gate/up rows per program where F = 256: few programs for the interpreter
E = 5
# Expert 4: four pairs (two in row 1), expert 0 and 2: two each, expert 1: one.
IDS = [[0, 4, 2], [4, 4, 1], [2, 0, 4]]
# Two row tiles (a partial one), four pairs per program (every run in one program); one row tile, two pairs
# per program (expert 4's run split over two programs), one activation plane. The interpreter never uses
# dp4a (CPU tensors); on a GPU both do.
# The last two take the down projection through the pair kernel (pair_down, the engine's default).
CONFIGS = [
    moe_grouped.GroupedConfig(bn_gu=16, bn_dn=32, pairs=4, pairs_dn=4, sign_math=False),
    moe_grouped.GroupedConfig(bn_gu=32, bn_dn=64, pairs=2, pairs_dn=1, terms=1, warps=2),
    moe_grouped.GroupedConfig(bn_gu=16, pairs=4, pair_down=True),
    moe_grouped.GroupedConfig(bn_gu=32, pairs=2, terms=1, warps=2, pair_down=True),
    # gate/up on the int8 tensor cores (one and two warps: 16 and 32 rows a program; the lane arithmetic of
    # the fragments runs in the interpreter through _mma_rows, the PTX mma on a GPU)
    moe_grouped.GroupedConfig(mma=True, prmt=True, warps=1, mma_dn=True),
    moe_grouped.GroupedConfig(mma=True, prmt=True, lds=True, lds_rep=16, warps=2, mma_dn=True),
    moe_grouped.GroupedConfig(mma=True, prmt=True, warps=1, sign_math=False, sign_prmt=True),  # signs by PRMT
]


def _stack(qtype, shape, seed):
    return pack(random_blocks(qtype, shape, std=0.05, generator=generator(seed)), qtype, shape)


def _case(F: int, K: int, D: int, ids, seed: int):
    """(gate, up [E, F, K] IQ2_XXS, down [E, D, K] Q2_K, ids [B, k], x [B, K], mid [B, k, K], weights): the
    down stack takes K-wide mid rows so that F can be a partial row tile (a Q2_K row is whole blocks)."""
    wg, wu = _stack(GGMLType.IQ2_XXS, (E, F, K), seed), _stack(GGMLType.IQ2_XXS, (E, F, K), seed + 1)
    wd = _stack(GGMLType.Q2_K, (E, D, K), seed + 2)
    ids = torch.tensor(ids, dtype=torch.int32, device=DEVICE)
    B, k = ids.shape
    gen = generator(seed + 3)
    x = torch.randn(B, K, generator=gen, device=DEVICE)
    mid = torch.randn(B, k, K, generator=gen, device=DEVICE)
    weights = torch.rand(B, k, generator=gen, device=DEVICE)
    return wg, wu, wd, ids, x, mid, weights


def test_expert_runs_match_python_grouping():
    ids = torch.tensor([[3, 0, 9], [3, -1, 3], [1, 0, 5]], device=DEVICE)  # E = 5: 9, -1, 5 are no expert
    runs = moe_grouped.expert_runs(ids, 5)
    order, eid, offs = runs.order.tolist(), runs.eid.tolist(), runs.offsets.tolist()
    flat = ids.reshape(-1).tolist()
    want = sorted(range(9), key=lambda p: (flat[p] if 0 <= flat[p] < 5 else 5, p))  # stable
    assert order == want
    assert eid == [flat[p] if 0 <= flat[p] < 5 else 5 for p in want]
    assert offs == [0, 2, 3, 3, 6, 6, 9]  # experts 0 1 2 3 4, then the sentinel run of 3
    assert runs.order.dtype == runs.eid.dtype == runs.offsets.dtype == torch.int32


@pytest.mark.parametrize(("B", "k", "E"), [(1, 6, 256), (7, 6, 256), (32, 6, 256), (64, 6, 256), (5, 3, 4)])
def test_expert_runs_kernel_equals_the_sort(B, k, E):
    """The counting kernel (_expert_runs_kernel) vs its torch twin, the stable sort, on random ids with
    out-of-range ones (-3, E, E + 7: the sentinel run), int32 and int64 ids."""
    gen = torch.Generator().manual_seed(B * 100 + E)
    ids = torch.randint(0, E, (B, k), generator=gen)
    bad = torch.rand(B, k, generator=gen) < 0.1
    ids = torch.where(bad, torch.tensor([-3, E, E + 7])[torch.randint(0, 3, (B, k), generator=gen)], ids)
    e = torch.where((ids >= 0) & (ids < E), ids, E)
    want = moe_grouped._runs_by_sort(e, E)
    for dtype in (torch.int32, torch.int64):
        runs = moe_grouped.expert_runs(ids.to(dtype).to(DEVICE), E)
        for got, ref_t in zip((runs.order, runs.eid, runs.offsets), want, strict=True):
            assert got.dtype == torch.int32 and torch.equal(got.cpu(), ref_t), dtype
    assert B * k <= moe_grouped.RUNS_KERNEL_MAX  # the kernel's range (beyond it: the sort itself)


def _cfg_id(c: moe_grouped.GroupedConfig) -> str:
    tile = f"mma-w{c.warps}" if c.mma else f"bn{c.bn_gu}-{c.bn_dn}-pt{c.pairs}-{c.pairs_dn}"
    return f"{tile}-t{c.terms}" + "-pairdown" * (c.pair_down and not c.mma_dn) + "-mmadown" * c.mma_dn


@pytest.mark.parametrize("cfg", CONFIGS, ids=_cfg_id)
def test_grouped_kernels_match_int8_twin(cfg):
    wg, wu, wd, ids, x, mid, weights = _case(24, 256, 40, IDS, 50)  # partial row tiles: 24, 40 rows
    got = moe_grouped.moe_gate_up_grouped(x, wg, wu, ids, 1.0, cfg)
    assert got.shape == (3, 3, 24) and got.dtype == torch.float32
    assert rel_err(got, ref.moe_gate_up_q8k(x, wg, wu, ids, 1.0, cfg.terms)) < F32_TOL
    got = moe_grouped.moe_down_grouped(mid, weights, wd, ids, cfg)
    assert got.shape == (3, 40) and got.dtype == torch.float32
    assert rel_err(got, ref.moe_down_q8k(mid, weights, wd, ids, cfg.terms)) < F32_TOL


@pytest.mark.parametrize(
    "variant",
    [
        {"sign_math": True},
        {"grid16": True},
        {"sign_math": True, "grid16": True},
        {"prmt": True},
        {"prmt": True, "sign_math": True},
        {"chain": True},
        {"prmt": True, "pos_reg": True},
        {"prmt": True, "chain": True, "pos_reg": True},
        {"prmt": True, "grid16": True},
        {"prmt": True, "grid16": True, "sign_math": True},
        {"prmt": True, "smem": 1},
        {"prmt": True, "smem": 2},
        {"prmt": True, "lds": True},
        {"prmt": True, "lds": True, "sign_math": True},
        {"prmt": True, "lds": True, "pos_reg": True},
        {"prmt": True, "lds": True, "chain": True, "pos_reg": True},
        {"prmt": True, "lds": True, "chain": True, "pos_reg": True, "bn_gu": 32, "pairs": 2},
        {"prefetch": True},
        {"prmt": True, "prefetch": True, "pairs": 2},
        {"prmt": True, "lds": True, "prefetch": True},
        {"prmt": True, "lds": True, "lds_rep": 16},
        {"prmt": True, "lds": True, "lds_rep": 32},
        {"prmt": True, "lds": True, "lds_rep": 16, "sign_prmt": True},
        {"prmt": True, "sign_prmt": True},
        {"prmt": True, "lds": True, "lds_rep": 16, "maxnreg": 64},
        {"prmt": True, "lds": True, "lds_rep": 16, "sign_math": True},
        {"prmt": True, "lds": True, "lds_rep": 8, "pos_reg": True},
    ],
    ids=lambda v: "+".join(v),
)
def test_grouped_decode_variants_change_no_bit(variant):
    """GroupedConfig.sign_math (computed sign masks), .grid16 (the 16-bit code table) and .prmt (nibble
    tables, byte permutes; with sign_math the sign nibbles computed; pos_reg: their source word loaded;
    smem: the tables looked up by tl.gather; lds: read from the kernel's static shared copy) decode the
    same signed grid words, .chain sums the same integers and .prefetch loads the same bytes a step early:
    gate/up equals the gathered-mask 8-byte-row decode bit for bit at the same row tile (the tile sets the
    order of the final row sums)."""
    wg, wu, _, ids, x, _, _ = _case(24, 256, 40, IDS, 52)
    cfg = replace(CONFIGS[0], **variant)
    want = moe_grouped.moe_gate_up_grouped(x, wg, wu, ids, 1.0, replace(CONFIGS[0], bn_gu=cfg.bn_gu))
    got = moe_grouped.moe_gate_up_grouped(x, wg, wu, ids, 1.0, cfg)
    if cfg.bn_gu == 32 and cfg.chain:  # on the GPU chain's [BN, 8] partials take another layout at bn 32,
        assert rel_err(got, want) < F32_TOL  # so the row sums' f32 order differs (the integers do not)
    else:
        assert torch.equal(got, want)


@pytest.mark.parametrize("cfg", CONFIGS[2:4], ids=["t2", "t1"])
def test_grouped_pair_down_prefetch_matches_plain_loop(cfg):
    """GroupedConfig.prefetch_dn (the pair down kernel loading block kt + 1 before computing kt; its partials
    kept per 16-byte group, so the f32 order differs) equals the plain loop's and the twin's within
    F32_TOL."""
    _, _, wd, ids, _, mid, weights = _case(24, 256, 40, IDS, 57)
    want = moe_grouped.moe_down_grouped(mid, weights, wd, ids, cfg)
    got = moe_grouped.moe_down_grouped(mid, weights, wd, ids, replace(cfg, prefetch_dn=True))
    assert rel_err(got, want) < F32_TOL
    assert rel_err(got, ref.moe_down_q8k(mid, weights, wd, ids, cfg.terms)) < F32_TOL


def test_grouped_gate_up_given_planes():
    """xq (the HC finish's Q8_K planes of x) read instead of quantizing x: quantize_q8k's planes change no
    bit, other planes change the result, through moe_routed_grouped too."""
    wg, wu, wd, ids, x, _, weights = _case(256, 256, 16, IDS, 81)  # F = K: mid feeds the down stack
    cfg = CONFIGS[0]
    q, d = moe_grouped.quantize_q8k(x, cfg.terms)
    want = moe_grouped.moe_gate_up_grouped(x, wg, wu, ids, 1.0, cfg)
    assert torch.equal(moe_grouped.moe_gate_up_grouped(x, wg, wu, ids, 1.0, cfg, xq=(q, d)), want)
    assert rel_err(moe_grouped.moe_gate_up_grouped(x, wg, wu, ids, 1.0, cfg, xq=(q, d * 2)), want) > 1e-3
    full = moe_grouped.moe_routed_grouped(x, ids, weights, wg, wu, wd, 1.0, cfg)
    assert torch.equal(moe_grouped.moe_routed_grouped(x, ids, weights, wg, wu, wd, 1.0, cfg, xq=(q, d)), full)


@pytest.mark.parametrize("pair_down", [False, True])
def test_routed_grouped_other_ranks_experts_add_nothing(pair_down):
    """Ids outside [0, E) (here 7 and -1) give zero mid rows and no down contribution, through the grouped
    down kernel and through the pair one; the rest equals the twin on the valid pairs only (their weights
    kept, the others' zeroed)."""
    ids_l = [[0, 7, 2], [4, 4, -1], [2, 0, 4]]
    wg, wu, wd, ids, x, _, weights = _case(256, 256, 16, ids_l, 60)  # F = K: mid feeds the down stack
    cfg = moe_grouped.GroupedConfig(bn_gu=WIDE, bn_dn=16, pairs=3, pairs_dn=3, pair_down=pair_down)
    mid = moe_grouped.moe_gate_up_grouped(x, wg, wu, ids, 10.0, cfg)
    ok = (ids >= 0) & (ids < E)
    safe = torch.where(ok, ids, 0)
    assert torch.equal(mid[~ok], torch.zeros_like(mid[~ok]))
    assert rel_err(mid[ok], ref.moe_gate_up_q8k(x, wg, wu, safe, 10.0)[ok]) < F32_TOL
    got = moe_grouped.moe_routed_grouped(x, ids, weights, wg, wu, wd, 10.0, cfg)
    mid_ref = ref.moe_gate_up_q8k(x, wg, wu, safe, 10.0)
    want = ref.moe_down_q8k(mid_ref, weights * ok, wd, safe)
    assert rel_err(got, want) < CHAIN_TOL
    assert rel_err(got, ref.moe_down_q8k(mid_ref, weights, wd, safe)) > 1e-3  # the zeroing is visible


def test_mma_kernels_long_runs_and_other_ranks():
    """The tensor-core gate/up and down (GroupedConfig.mma, mma_dn) where one expert has 6 pairs (split over
    two programs of 4 pair columns), ids outside [0, E) give zero rows / terms, and the second row tile is
    partial (40 rows at 32 a program): the valid ones equal the twin within F32_TOL (gate/up with and
    without the clamp; down per slot, on random mid rows)."""
    ids_l = [[4, 7, 2], [4, 4, -1], [2, 0, 4], [4, 1, 4]]
    wg, wu, wd, ids, x, mid, weights = _case(40, 512, 40, ids_l, 64)
    cfg = moe_grouped.GroupedConfig(mma=True, prmt=True, warps=2, mma_dn=True)
    ok = (ids >= 0) & (ids < E)
    safe = torch.where(ok, ids, 0)
    for clamp in (0.0, 1.0):
        got = moe_grouped.moe_gate_up_grouped(x, wg, wu, ids, clamp, cfg)
        assert torch.equal(got[~ok], torch.zeros_like(got[~ok]))
        assert rel_err(got[ok], ref.moe_gate_up_q8k(x, wg, wu, safe, clamp)[ok]) < F32_TOL
    got = moe_grouped.moe_down_grouped(mid, weights, wd, ids, cfg, per_slot=True)
    assert torch.equal(got[~ok], torch.zeros_like(got[~ok]))
    for j in range(ids.shape[1]):
        want = ref.moe_down_q8k(mid[:, j, None], weights[:, j, None] * ok[:, j, None], wd, safe[:, j, None])
        assert rel_err(got[:, j], want) < F32_TOL


def test_mma_config_needs_two_planes_and_nibbles():
    for bad in ({"terms": 1, "prmt": True}, {"prmt": False}, {"prmt": True, "grid16": True}):
        with pytest.raises(ValueError, match="mma needs"):
            moe_grouped.GroupedConfig(mma=True, **bad)
    with pytest.raises(ValueError, match="lds_rep 64 needs mma"):  # 48 KB static: the dp4a launch fails
        moe_grouped.GroupedConfig(prmt=True, lds=True, lds_rep=64)
    with pytest.raises(ValueError, match="mma_dn needs"):
        moe_grouped.GroupedConfig(mma_dn=True, terms=1)


@pytest.mark.parametrize("down", ["grouped", "pair", "pair sorted", "mma"])
def test_down_other_ranks_experts_add_nothing_on_any_mid(down):
    """The down projection alone, on random (nonzero) mid rows: the per-slot terms of ids outside [0, E) are
    zero, the others equal the twin's (the gate/up zeros would hide a down kernel that read a clamped
    expert); through the grouped kernel, the pair kernel, and the pair kernel taking the pairs in expert
    order (sorted_down), which equals the unsorted one bit for bit."""
    ids_l = [[0, 7, 2], [4, 4, -1], [2, 0, 4]]
    _, _, wd, ids, _, mid, weights = _case(16, 256, 40, ids_l, 62)
    cfg = moe_grouped.GroupedConfig(bn_dn=16, pairs_dn=2, pair_down=down != "grouped", mma_dn=down == "mma")
    got = moe_grouped.moe_down_grouped(mid, weights, wd, ids, cfg, per_slot=True)  # [B, k, D]
    if down == "pair sorted":
        from dataclasses import replace

        unsorted = got
        cfg = replace(cfg, sorted_down=True)
        got = moe_grouped.moe_down_grouped(mid, weights, wd, ids, cfg, per_slot=True)
        assert torch.equal(got, unsorted)
    ok = (ids >= 0) & (ids < E)
    assert torch.equal(got[~ok], torch.zeros_like(got[~ok]))
    safe = torch.where(ok, ids, 0)
    for j in range(ids.shape[1]):
        want = ref.moe_down_q8k(mid[:, j, None], weights[:, j, None] * ok[:, j, None], wd, safe[:, j, None])
        assert rel_err(got[:, j], want) < F32_TOL


def test_bad_input_is_named():
    wg, wu, wd, ids, x, mid, weights = _case(16, 256, 16, IDS, 70)
    with pytest.raises(ValueError, match="IQ2_XXS"):
        moe_grouped.moe_gate_up_grouped(x, wd, wd, ids, 1.0)
    with pytest.raises(ValueError, match="ids must be"):
        moe_grouped.moe_gate_up_grouped(x, wg, wu, ids[:2], 1.0)
    with pytest.raises(ValueError, match="pairs must be"):
        moe_grouped.GroupedConfig(pairs=5)
    with pytest.raises(ValueError, match="pairs_dn must be"):
        moe_grouped.GroupedConfig(pairs_dn=0)
    with pytest.raises(ValueError, match="smem needs"):
        moe_grouped.GroupedConfig(prmt=True, sign_math=True, smem=1)
    with pytest.raises(ValueError, match="smem must be"):
        moe_grouped.GroupedConfig(prmt=True, smem=3)
    with pytest.raises(ValueError, match="pos_reg needs"):
        moe_grouped.GroupedConfig(prmt=True, grid16=True, pos_reg=True)
    with pytest.raises(ValueError, match="lds needs"):
        moe_grouped.GroupedConfig(prmt=True, sign_math=False, lds=True, smem=1)
    with pytest.raises(ValueError, match="sign_prmt needs"):
        moe_grouped.GroupedConfig(prmt=True, sign_math=True, sign_prmt=True)


@triton.jit
def _sign_sel_kernel(out_ptr, PTX: tl.constexpr):
    si = tl.arange(0, 128)
    tl.store(out_ptr + si, moe._sign_sel(si, PTX))


def test_sign_sel_is_the_sign_nibble_table():
    """moe._sign_sel (GroupedConfig.sign_prmt: the sign nibbles by one byte permute) equals the table it
    replaces, iq2_sign_nibbles (built from KSIGNS), at all 128 sign indices: the parity bit included."""
    out = torch.zeros(128, dtype=torch.int32, device=DEVICE)
    _sign_sel_kernel[(1,)](out, PTX=CUDA)
    assert torch.equal(out.cpu(), iq2_sign_nibbles(torch.device("cpu")).cpu())


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="Flash widths: GPU only")
def test_flash_widths_match_pair_kernels_and_capture():
    """K 4096, F 2048, 16 experts, B 32 rows of 6 (runs ~12 pairs: split over programs) against the current
    int8 pair kernels; B 4 against the twin; one CUDA graph replayed on new inputs."""
    Ef, K, F, k = 16, 4096, 2048, 6
    wg, wu = _stack(GGMLType.IQ2_XXS, (Ef, F, K), 80), _stack(GGMLType.IQ2_XXS, (Ef, F, K), 81)
    wd = _stack(GGMLType.Q2_K, (Ef, K, F), 82)
    gen = generator(83)

    def inputs(B):
        ids = torch.rand(B, Ef, device=DEVICE, generator=gen).argsort(1)[:, :k].int()
        x = torch.randn(B, K, device=DEVICE, generator=gen)
        return ids, x, torch.rand(B, k, device=DEVICE, generator=gen)

    ids, x, w = inputs(32)
    gu_cfg, dn_cfg = moe.MoeConfig(16, 1, 4, int8=True), moe.MoeConfig(64, 1, 4, int8=True)
    mid_pairs = moe.moe_gate_up(x, wg, wu, ids, 10.0, gu_cfg)
    mid = moe_grouped.moe_gate_up_grouped(x, wg, wu, ids, 10.0)
    assert rel_err(mid, mid_pairs) < F32_TOL
    dp4a = replace(moe_grouped.CONFIG, mma=False, mma_ld128=False, lds_rep=16)  # the default to session 27
    assert rel_err(moe_grouped.moe_gate_up_grouped(x, wg, wu, ids, 10.0, dp4a), mid_pairs) < F32_TOL
    mma_builds = ((4, 0, False, 16, 0), (2, 0, True, 16, 0), (4, 96, True, 16, 0), (8, 0, True, 64, 0))
    mma_builds += ((4, 0, True, 16, 1), (4, 0, True, 64, 0))
    for warps, maxnreg, ld128, rep, sprmt in mma_builds:  # the tensor-core gate/up
        cfg = replace(moe_grouped.CONFIG, mma=True, warps=warps, maxnreg=maxnreg, mma_ld128=ld128)
        cfg = replace(cfg, lds_rep=rep, sign_prmt=bool(sprmt))
        assert rel_err(moe_grouped.moe_gate_up_grouped(x, wg, wu, ids, 10.0, cfg), mid_pairs) < F32_TOL
    moe_grouped.quad_pack_stack(wg)  # the quad layout (an experiment: the stacks packed a second time)
    moe_grouped.quad_pack_stack(wu)
    for maxnreg in (0, 128):
        qp = replace(moe_grouped.CONFIG, quad_pack=True, maxnreg=maxnreg)
        assert torch.equal(moe_grouped.moe_gate_up_grouped(x, wg, wu, ids, 10.0, qp), mid)  # the default's
    want_dn = moe.moe_down(mid_pairs, w, wd, ids, dn_cfg)
    for warps in (4, 2):  # the tensor-core down
        cfg = replace(moe_grouped.CONFIG, mma_dn=True, warps=warps)
        assert rel_err(moe_grouped.moe_down_grouped(mid_pairs, w, wd, ids, cfg), want_dn) < F32_TOL
    for pair_down in (False, True):
        cfg = replace(moe_grouped.CONFIG, pair_down=pair_down)
        got = moe_grouped.moe_down_grouped(mid_pairs, w, wd, ids, cfg)
        assert rel_err(got, moe.moe_down(mid_pairs, w, wd, ids, dn_cfg)) < F32_TOL
    ids4, x4, w4 = inputs(4)
    got4 = moe_grouped.moe_routed_grouped(x4, ids4, w4, wg, wu, wd, 10.0)
    want4 = ref.moe_down_q8k(ref.moe_gate_up_q8k(x4, wg, wu, ids4, 10.0), w4, wd, ids4)
    assert rel_err(got4, want4) < CHAIN_TOL
    s_ids, s_x, s_w = ids.clone(), x.clone(), w.clone()
    moe_grouped.moe_routed_grouped(s_x, s_ids, s_w, wg, wu, wd, 10.0)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = moe_grouped.moe_routed_grouped(s_x, s_ids, s_w, wg, wu, wd, 10.0)
    ids2, x2, w2 = inputs(32)
    s_ids.copy_(ids2), s_x.copy_(x2), s_w.copy_(w2)
    graph.replay()
    want = moe.moe_down(moe.moe_gate_up(x2, wg, wu, ids2, 10.0, gu_cfg), w2, wd, ids2, dn_cfg)
    assert rel_err(out, want) < CHAIN_TOL


@pytest.mark.parametrize("pair_down", [False, True])
def test_batch_routed_takes_grouped_path_and_expert_parallel(monkeypatch, pair_down):
    """batch._routed: from MOE_GROUPED_MIN_ROWS rows the grouped kernels, below them the pair path; under
    expert parallel (faked: rank 1 of 2, all_reduce the identity) only this rank's experts E .. 2E - 1 add,
    equal to the twin on those pairs (down grouped or by the pair kernel)."""
    from types import SimpleNamespace

    from ds4.model.cuda import batch

    cfg = moe_grouped.GroupedConfig(bn_gu=WIDE, bn_dn=16, pairs=2, pair_down=pair_down)
    monkeypatch.setattr(moe_grouped, "CONFIG", cfg)
    monkeypatch.setattr(batch, "MOE_GROUPED_MIN_ROWS", 8)
    monkeypatch.setattr(batch.kmoe, "GATE_UP", moe.MoeConfig(16, 1, 4, int8=True))
    calls = []
    spy = moe_grouped.moe_routed_grouped
    monkeypatch.setattr(
        batch.kgrouped, "moe_routed_grouped", lambda *a, **kw: calls.append(1) or spy(*a, **kw)
    )
    monkeypatch.setattr(  # the pair path's per-slot terms [B, k, d]
        batch, "routed_decode", lambda x, *a, **kw: torch.zeros(x.shape[0], 2, 16, device=x.device)
    )
    ids_g = [[5, 9], [1, 5], [7, 7], [0, 6], [9, 2], [5, 3], [8, 5], [4, 6]]  # global ids of 2 x 5 experts
    wg, wu, wd, ids, x, _, weights = _case(256, 256, 16, ids_g, 90)
    m = SimpleNamespace(gate_exps=wg, up_exps=wu, down_exps=wd)
    fake = SimpleNamespace(active=lambda: True, rank=lambda: 1, all_reduce_=lambda t: t)
    monkeypatch.setattr(batch, "dist", fake)
    got = batch._routed(x, ids, weights, m, 10.0)  # per slot [B, k, d]: the HC post kernel sums the slots
    assert calls == [1] and got.shape == (8, 2, 16)
    got = got.sum(1)
    local = ids - E
    own = (local >= 0) & (local < E)
    safe = torch.where(own, local, 0)
    want = ref.moe_down_q8k(ref.moe_gate_up_q8k(x, wg, wu, safe, 10.0), weights * own, wd, safe)
    assert rel_err(got, want) < CHAIN_TOL
    assert not torch.equal(own, torch.ones_like(own))  # some pairs are other ranks'
    assert torch.equal(
        batch._routed(x[:7], ids[:7], weights[:7], m, 10.0), torch.zeros(7, 2, 16, device=DEVICE)
    )  # pair path
    assert calls == [1]


@pytest.mark.parametrize("rows", [3, moe_grouped.SMALL_ROWS])
def test_pair_down_tile_below_small_rows(monkeypatch, rows):
    """The pair down kernel takes GroupedConfig.bn_pair_dn_small rows a program below SMALL_ROWS rows of x
    and bn_pair_dn from there (0: bn_pair_dn everywhere); the tile changes no result (the twin's sums)."""
    tiles = []
    real = moe_grouped.moe_down_slots
    monkeypatch.setattr(
        moe_grouped, "moe_down_slots", lambda m, w, wd, i, c, o: tiles.append(c.bn) or real(m, w, wd, i, c, o)
    )
    ids_l = [[j % E, (j + 2) % E] for j in range(rows)]
    _, _, wd, ids, _, mid, weights = _case(24, 256, 16, ids_l, 95)
    want = ref.moe_down_q8k(mid, weights, wd, ids, 2)
    for small, expect in ((32, 32 if rows < moe_grouped.SMALL_ROWS else 16), (0, 16)):
        cfg = moe_grouped.GroupedConfig(pair_down=True, bn_pair_dn=16, bn_pair_dn_small=small)
        assert rel_err(moe_grouped.moe_down_grouped(mid, weights, wd, ids, cfg), want) < F32_TOL
        assert tiles.pop() == expect


def test_mma_quad_layout_changes_no_bit():
    """GroupedConfig.quad_pack (the stacks reordered so that each lane of a quad loads its own group)
    gives the plain mma gate/up's result bit for bit (the same integer sums, scaled in the same order);
    without the packed words it refuses. (2 warps: the interpreter's runs of this kernel are this suite's
    slowest; 1 warp took 39 s more, and the GPU runs the engine's 4 in the Flash-width tests.)"""
    wg, wu, _, ids, x, _, _ = _case(24, 512, 40, IDS, 97)  # two super-blocks a row
    cfg = moe_grouped.GroupedConfig(mma=True, prmt=True, warps=2, mma_ld128=True)
    want = moe_grouped.moe_gate_up_grouped(x, wg, wu, ids, 10.0, cfg)
    qp = replace(cfg, quad_pack=True)
    with pytest.raises(ValueError, match="quad_pack needs the stacks packed"):
        moe_grouped.moe_gate_up_grouped(x, wg, wu, ids, 10.0, qp)
    qg, qu = to_quad(wg), to_quad(wu)  # the quad layout alone (QUAD_STACKS): read so whatever cfg says
    assert torch.equal(moe_grouped.moe_gate_up_grouped(x, qg, qu, ids, 10.0, cfg), want)
    moe_grouped.quad_pack_stack(wg)
    moe_grouped.quad_pack_stack(wu)
    assert torch.equal(moe_grouped.moe_gate_up_grouped(x, wg, wu, ids, 10.0, qp), want)
    with pytest.raises(ValueError, match="quad_pack needs mma"):
        moe_grouped.GroupedConfig(mma=True, prmt=True, quad_pack=True)
    with pytest.raises(ValueError, match="read by the mma kernel only"):
        moe_grouped.moe_gate_up_grouped(x, qg, qu, ids, 10.0, replace(cfg, mma=False, mma_ld128=False))
    with pytest.raises(ValueError, match="read with 16-byte loads"):
        moe_grouped.moe_gate_up_grouped(x, qg, qu, ids, 10.0, replace(cfg, mma_ld128=False))


def test_quad_pack_words():
    """quad_pack against the layout read off the sub-block bytes one field at a time (grid byte, 7-bit sign
    index, 4-bit scale of group t of sub-block s), on random rows."""
    w = _stack(GGMLType.IQ2_XXS, (2, 8, 512), 98)
    qp = moe_grouped.quad_pack(w, rows=5).view(16, 2, 4, 2).cpu()  # chunks of 5 rows: a partial last one
    qs, sg = w.data["qs"].cpu().view(16, 2, 8, 4), w.data["sg"].cpu().view(16, 2, 8).to(torch.int64)
    for r, kb, t, s in ((0, 0, 0, 0), (3, 1, 2, 5), (15, 1, 3, 7), (9, 0, 1, 3), (6, 1, 0, 4)):
        g, v = int(qp[r, kb, t, 0]), int(qp[r, kb, t, 1]) & (2**64 - 1)
        assert (g >> (8 * s)) & 255 == int(qs[r, kb, s, t])
        half = (v >> (32 * (s // 4))) & (2**32 - 1)
        assert (half >> (7 * (s % 4))) & 127 == (int(sg[r, kb, s]) >> (7 * t)) & 127
        own = (v >> (28 + 32 * (s % 2))) & 15  # lane s // 2 holds sub-block s's scale
        own_lane = (int(qp[r, kb, s // 2, 1]) >> (28 + 32 * (s % 2))) & 15
        assert own_lane == (int(sg[r, kb, s]) >> 28) & 15
        assert own == (int(sg[r, kb, 2 * t + s % 2]) >> 28) & 15
