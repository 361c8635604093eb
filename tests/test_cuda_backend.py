"""The device forward (ds4.model.cuda) against the official DeepSeek V4 logits and the CPU reference.

CI (no GPU) runs the same code on device="cpu" for the small official cases: the static-buffer state, the
graph-safe decode step and the chunked prefill are plain torch, so their math is checked everywhere. The
`cuda` tests run every official case (F32 and Q8_0) on the GPU with the decode step replayed from a CUDA
graph, a reduced-depth full-width synthetic Flash model against the CPU reference, and snapshots across
backends.
Bar (cuda_plan.md): same argmax at every step, logits within 2e-2 of the logit scale (std of the logits).
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from _gguf_model import load_model
from _roundtrips import round_trips_off
from conftest import OFFICIAL_TINY

from ds4.engine.session import Session
from ds4.gguf import open_model
from ds4.kernels import moe
from ds4.model.cuda import CudaModel, gguf_source

REL_TOL = 2e-2  # max |dlogit| / std(logits)


def _cases(kind: str) -> list[dict]:
    path = OFFICIAL_TINY / "cases.json"
    return json.loads(path.read_text())[kind] if path.exists() else []


@pytest.fixture(scope="module")
def expected_logits() -> dict[str, np.ndarray]:
    with np.load(OFFICIAL_TINY / "logits.npz") as z:
        return {k: z[k] for k in z.files}


def device_model(path: Path, device: str, **kw) -> CudaModel:
    mf = open_model(path)
    return CudaModel(mf.config, gguf_source(mf), has=mf.has, device=device, **kw)


def run_case(model, case: dict) -> np.ndarray:
    tokens, chunks = case["tokens"], case["chunks"]
    state = model.new_state(len(tokens) + 8)
    out, start = [], 0
    for end in chunks:
        out.append(model.forward(state, tokens[start:end]).cpu())
        start = end
    for tok in tokens[start : start + case["decode_steps"]]:
        out.append(model.forward(state, [tok]).cpu())
    return torch.stack(out).numpy()


def check_close(got: np.ndarray, want: np.ndarray, label: str) -> float:
    assert got.shape == want.shape
    assert got.argmax(1).tolist() == want.argmax(1).tolist(), f"{label}: argmax differs"
    rel = float(np.abs(got - want).max() / want.std())
    print(f"{label}: max |dlogit| / std = {rel:.2e}")
    assert rel <= REL_TOL, f"{label}: {rel:.3e} > {REL_TOL}"
    return rel


# ---- CPU device (CI) ---------------------------------------------------------------------------


@pytest.mark.parametrize("key", ["short", "window_edge"])
def test_device_path_on_cpu_matches_official(official_gguf, expected_logits, key):
    torch.set_num_threads(1)
    case = next(c for c in _cases("cases") if c["logits_key"] == key)
    got = run_case(device_model(official_gguf, "cpu"), case)
    check_close(got, expected_logits[key], key)


def test_device_snapshot_restores_on_cpu(official_gguf):
    """Device session -> DSV4 payload -> CPU session: continuing there equals continuing on the device."""
    torch.set_num_threads(1)
    cpu_model = load_model(official_gguf)
    cfg = cpu_model.cfg
    dev = SimpleNamespace(model=device_model(official_gguf, "cpu"), config=cfg)
    cpu = SimpleNamespace(model=cpu_model, config=cfg)
    prompt = list(range(1000, 1041))  # 41 tokens: past the window, partial frontiers at both ratios
    a = Session(dev, 64, checkpoint=False)
    a.sync(prompt)
    b = Session(cpu, 64, checkpoint=False)
    b.restore(a.snapshot())
    assert b.snapshot() == a.snapshot()
    for tok in (5, 6, 7):
        la, lb = a.eval(tok).numpy(), b.eval(tok).numpy()
        assert la.argmax() == lb.argmax()
        assert np.abs(la - lb).max() <= 1e-4 * max(1.0, float(np.abs(lb).max()))
    c = Session(dev, 64, checkpoint=False)  # and back: CPU payload restored on the device path
    c.restore(b.snapshot())
    np.testing.assert_allclose(c.eval(9).numpy(), b.eval(9).numpy(), atol=1e-4)


# ---- GPU -----------------------------------------------------------------------------------------


@pytest.mark.cuda
@pytest.mark.parametrize("case", _cases("cases") + _cases("q8_cases"), ids=lambda c: c["logits_key"])
def test_cuda_matches_official(official_gguf, official_q8_gguf, expected_logits, case):
    path = official_gguf if case["weights"] == "model.gguf" else official_q8_gguf
    got = run_case(_cached_cuda(path), case)
    check_close(got, expected_logits[case["logits_key"]], case["logits_key"])


_MODELS: dict[Path, CudaModel] = {}


def _cached_cuda(path: Path) -> CudaModel:
    if path not in _MODELS:
        _MODELS[path] = device_model(path, "cuda")
    return _MODELS[path]


@pytest.mark.cuda
def test_cuda_snapshot_roundtrip(official_gguf):
    cpu_model = load_model(official_gguf)
    dev = SimpleNamespace(model=_cached_cuda(official_gguf), config=cpu_model.cfg)
    cpu = SimpleNamespace(model=cpu_model, config=cpu_model.cfg)
    a = Session(dev, 400, checkpoint=False)
    a.sync(list(range(2000, 2300)))
    b = Session(cpu, 400, checkpoint=False)
    b.restore(a.snapshot())
    for tok in (11, 12, 13, 14):
        la, lb = a.eval(tok).numpy(), b.eval(tok).numpy()
        assert la.argmax() == lb.argmax()
        assert np.abs(la - lb).max() / lb.std() <= REL_TOL


@pytest.mark.cuda
def test_cuda_decode_graph_recaptured_after_its_session_is_gone(official_gguf):
    """A session's decode graph dies with it; the next session's capture must not reuse the released pool
    (torch's allocator asserted on that) and must decode like the first one did."""
    import gc

    model = _cached_cuda(official_gguf)
    want = None
    for _ in range(2):
        st = model.new_state(64)
        model.forward(st, list(range(100, 120)))
        got = model.decode_greedy(st, 7, 4).tolist()
        assert st._runner is not None and st._runner.graph is not None  # the steps replayed a graph
        assert want is None or got == want
        want = got
        del st
        gc.collect()


@pytest.mark.cuda
def test_cuda_side_stream_branches_change_no_bit(official_gguf, monkeypatch):
    """The decode step's side-stream branches (ds4.model.cuda.streams) run the same kernels on the same
    inputs: greedy tokens and the last logits are bit-identical with them off (each state captures its own
    graph under the switch in force)."""
    from ds4.model.cuda import streams

    model = _cached_cuda(official_gguf)
    out = {}
    for on in (True, False):
        monkeypatch.setattr(streams, "CONCURRENT", on)
        st = model.new_state(96)
        model.forward(st, list(range(100, 150)))  # past the window (16) and several ratio-4 / 32 rows
        toks = model.decode_greedy(st, 7, 8).tolist()
        out[on] = (toks, st._runner.logits.clone())
    assert out[True][0] == out[False][0]
    assert torch.equal(out[True][1], out[False][1])


@pytest.mark.cuda
def test_cuda_prefetch_changes_no_bit(official_gguf, monkeypatch):
    """Static weights prefetched into L2 at every site (layer.PREFETCH, side lane 4) change timing only:
    greedy tokens and the last logits are bit-identical with them on."""
    from ds4.model.cuda import layer

    model = _cached_cuda(official_gguf)
    out = {}
    for mb in (0, 64):
        monkeypatch.setattr(layer, "PREFETCH", {"attn": mb, "o": mb, "ffn": mb} if mb else {})
        st = model.new_state(96)
        model.forward(st, list(range(100, 150)))
        toks = model.decode_greedy(st, 7, 8).tolist()
        out[mb] = (toks, st._runner.logits.clone())
    assert out[0][0] == out[64][0]
    assert torch.equal(out[0][1], out[64][1])


@pytest.mark.cuda
def test_cuda_wide_select_changes_no_bit(official_gguf, monkeypatch):
    """The indexer's top-k by the several-programs-a-row select (layer.INDEXER_WIDE; its chunks shrunk so
    that the official model's 75-100 rows span up to 4 programs), at both digit sets (topk.WIDE_DIGITS),
    instead of the one-program select: the same set in the same ascending order, so bit-identical greedy
    tokens and logits."""
    from ds4.kernels import topk
    from ds4.model.cuda import layer

    model = _cached_cuda(official_gguf)
    out = {}
    for mode in ("one", "d11", "d8"):
        wide = mode != "one"
        monkeypatch.setattr(layer, "INDEXER_WIDE", wide)
        if wide:
            monkeypatch.setattr(layer, "INDEXER_SELECT_MAX", 4)  # every indexer row past it
            monkeypatch.setattr(layer, "INDEXER_WIDE_MAX", 1 << 18)
            monkeypatch.setattr(topk, "WIDE_MIN_CHUNK", 32)
            monkeypatch.setattr(topk, "WIDE_PROGRAMS", 4)
            digits = topk.WIDE_DIGITS_8 if mode == "d8" else topk.WIDE_DIGITS_11
            monkeypatch.setattr(topk, "WIDE_DIGITS", digits)
        st = model.new_state(400)
        model.forward(st, list(range(100, 400)))
        toks = model.decode_greedy(st, 7, 8).tolist()
        out[mode] = (toks, st._runner.logits.clone())
    for mode in ("d11", "d8"):
        assert out[mode][0] == out["one"][0], mode
        assert torch.equal(out[mode][1], out["one"][1]), mode


@pytest.mark.cuda
def test_cuda_hc_comb_on_side_lane(official_gguf, monkeypatch):
    """The HC combine Sinkhorn as its own launch on side lane 2 (fused.HC_COMB_SIDE) vs inside the finish
    kernel: the same normalisations (each 4-term sum maybe in another association), so the same greedy
    tokens and logits within 1e-3 of their scale (an FP8 rounding point may move)."""
    from ds4.model.cuda import fused as cfused

    model = _cached_cuda(official_gguf)
    out = {}
    for on in (True, False):
        monkeypatch.setattr(cfused, "HC_COMB_SIDE", on)
        st = model.new_state(96)
        model.forward(st, list(range(100, 150)))
        toks = model.decode_greedy(st, 7, 8).tolist()
        out[on] = (toks, st._runner.logits.clone().float())
    assert out[True][0] == out[False][0]
    a, b = out[True][1], out[False][1]
    assert float((a - b).abs().max()) <= 1e-3 * float(b.abs().max())


@pytest.mark.cuda
def test_cuda_tail_fused_matches_torch_tail(official_gguf, monkeypatch):
    """The output head's HC collapse + norm and the hash layers' routing as Triton launches
    (cfused.TAIL_FUSED) vs the torch chains: the same math in another summation order, so the same greedy
    tokens and logits within 1e-3 of their scale; prefill (the head at the last row) too."""
    from ds4.model.cuda import fused as cfused

    model = _cached_cuda(official_gguf)
    assert any(blk.w.moe.tid2eid is not None for blk in model.layers)  # hash layers are exercised
    out = {}
    for on in (True, False):
        monkeypatch.setattr(cfused, "TAIL_FUSED", on)
        st = model.new_state(96)
        first = model.forward(st, list(range(100, 150))).float()
        toks = model.decode_greedy(st, 7, 8).tolist()
        out[on] = (toks, st._runner.logits.clone().float(), first)
    assert out[True][0] == out[False][0]
    for a, b in ((out[True][1], out[False][1]), (out[True][2], out[False][2])):
        assert float((a - b).abs().max()) <= 1e-3 * float(b.abs().max())


@pytest.mark.cuda
def test_cuda_ctx_bucket_graphs_change_no_bit(official_gguf, monkeypatch):
    """Decode graphs per context bucket (model.CTX_BUCKETS, buckets of 32 tokens up for the tiny model):
    greedy decode across two bucket boundaries replays one graph per bucket and equals the single graph
    of the whole allocation bit for bit."""
    from ds4.model.cuda import model as cm

    model = _cached_cuda(official_gguf)
    monkeypatch.setattr(cm, "CTX_BUCKET_MIN", 32)
    out = {}
    for on in (False, True):
        monkeypatch.setattr(cm, "CTX_BUCKETS", on)
        st = model.new_state(256)
        model.forward(st, list(range(100, 130)))
        toks = model.decode_greedy(st, 7, 40).tolist()  # positions 30..69: buckets 32, 64, 128
        out[on] = (toks, st._runner.logits.clone(), set(st._runner.by_bound))
    assert out[False][2] == {None} and out[True][2] == {32, 64, 128}
    assert out[True][0] == out[False][0]
    assert torch.equal(out[True][1], out[False][1])


@pytest.mark.cuda
def test_cuda_flash_width_synthetic_matches_cpu():
    """4 layers at full Flash width (16 experts to keep the CPU reference in memory), q2 mix, built on the
    GPU; a 2,100-token prompt makes the ratio-4 indexer select (more than top-k = 512 rows visible)."""
    from ds4.config import FLASH
    from ds4.layout import tensor_specs
    from ds4.model import DS4Model
    from ds4.quant import dequantize
    from ds4.tools.synthetic import build_weights

    cfg = replace(FLASH, n_layer=4, n_expert=16, compress_ratios=FLASH.compress_ratios[:4])
    raw = build_weights(cfg, "q2", seed=3, device="cuda")
    shapes = {s.name: s.shape for s in tensor_specs(cfg)}

    def cpu_get(name):
        qt, b = raw[name]
        return dequantize(b.reshape(-1), qt, shapes[name]).cpu()

    ref = DS4Model(cfg, cpu_get, has=lambda n: n in raw)
    dev = CudaModel(cfg, lambda n: raw[n], has=lambda n: n in raw, device="cuda", dtype=torch.float32)
    prompt = [(i * 7919) % cfg.n_vocab for i in range(2100)]
    rs, ds = ref.new_state(2200), dev.new_state(2200)
    got, want = [dev.forward(ds, prompt).cpu()], [ref.forward(rs, prompt)]
    tok = int(want[-1].argmax())
    for _ in range(5):
        got.append(dev.forward(ds, [tok]).cpu())
        want.append(ref.forward(rs, [tok]))
        tok = int(want[-1].argmax())
    check_close(torch.stack(got).numpy(), torch.stack(want).numpy(), "flash-width 4 layers")


@pytest.mark.parametrize(("fast", "quad"), [(False, False), (True, False), (True, True)],
                         ids=["plain", "kernel-layout", "quad-layout"])  # fmt: skip
def test_device_path_on_cpu_matches_reference_on_tiny_q2(monkeypatch, fast: bool, quad: bool):
    """The tiny synthetic q2 model (IQ2_XXS/Q2_K experts, indexer selecting top-8 of 75 rows): device code
    on the CPU vs the CPU reference, with the FP8/FP4 round trips off on both sides (round_trips_off says
    why; the official-tiny cases above cover the device path with them on). Then only float32 summation
    order differs, so the logits agree to ~1e-5 of their std on any CPU. fast: the GPU's weight layout
    (packed kernels' twins, merged q_a+kv / shared gate+up, float16 side matrices read by hmatvec); quad:
    with the routed gate / up stacks in the quad layout (moe_grouped.QUAD_STACKS)."""
    from ds4.kernels import moe_grouped

    monkeypatch.setattr(moe_grouped, "QUAD_STACKS", quad)
    from ds4.config import TINY
    from ds4.layout import tensor_specs
    from ds4.model import DS4Model
    from ds4.quant import dequantize
    from ds4.tools.synthetic import build_weights

    torch.set_num_threads(1)
    calls = round_trips_off(monkeypatch)
    raw = build_weights(TINY, "q2", seed=3)
    shapes = {s.name: s.shape for s in tensor_specs(TINY)}
    ref = DS4Model(
        TINY, lambda n: dequantize(raw[n][1].reshape(-1), raw[n][0], shapes[n]), has=raw.__contains__
    )
    kw = dict(kernels=True, side_half=True) if fast else {}
    dev = CudaModel(TINY, lambda n: raw[n], has=raw.__contains__, device="cpu", **kw)
    if fast:  # the layout under test is really there
        assert all(blk.side is not None and blk.side.xn is not None for blk in dev.layers if blk.shape.ratio)
        stacks = [
            s for blk in dev.layers for s in (blk.w.moe.gate_exps, blk.w.moe.up_exps, blk.w.moe.down_exps)
        ]
        assert [s.quad for s in stacks] == [quad, quad, False] * len(dev.layers)
    prompt = [(i * 7919) % TINY.n_vocab for i in range(300)]
    rs, ds = ref.new_state(320), dev.new_state(320)
    counts = []  # round-trip calls after: reference, device prefill, device decode
    want, toks = [ref.forward(rs, prompt)], []
    for _ in range(5):  # positions 300..304: a ratio-4 window completes at 303 (compressor rows written)
        toks.append(int(want[-1].argmax()))
        want.append(ref.forward(rs, [toks[-1]]))
    counts.append(dict(calls))
    got = [dev.forward(ds, prompt)]
    counts.append(dict(calls))
    got += [dev.forward(ds, [tok]) for tok in toks]
    counts.append(dict(calls))
    for before, after in zip([{"fp8": 0, "fp4": 0}, *counts], counts, strict=False):  # every site patched
        assert all(after[k] > before[k] for k in after), f"a round trip was not replaced: {counts}"
    rel = check_close(torch.stack(got).numpy(), torch.stack(want).numpy(), "tiny q2")
    # float32 both sides: only summation order differs; the kernel layout's routed experts take their
    # activations as two-term Q8_K integers (ds4.kernels.moe: ~3e-5 of each expert output; one term: ~1 %)
    assert rel < (2e-3 if fast and moe.GATE_UP.int8 else 1e-4)


def test_device_session_rewind_and_reset_in_place(official_gguf):
    """Rewinding to the prompt checkpoint and resetting keep the device state's buffers (and so its decode
    graph); the results equal a fresh session's."""
    torch.set_num_threads(1)
    model = device_model(official_gguf, "cpu")
    eng = SimpleNamespace(model=model, config=model.cfg)
    s = Session(eng, 64)
    prompt = list(range(3000, 3030))
    s.sync(prompt)
    buffers = [t.data_ptr() for t in s.state.layers[2].tensors()]
    first = s.eval(7).clone()
    s.sync(prompt + [8])  # drops the decoded 7: rewinds to the checkpoint, then prefills 8
    assert s.stats.checkpoint_hits == 1
    assert [t.data_ptr() for t in s.state.layers[2].tensors()] == buffers
    fresh = Session(eng, 64, checkpoint=False)
    fresh.sync(prompt + [8])
    np.testing.assert_allclose(s.logits.numpy(), fresh.logits.numpy(), atol=1e-5)
    s.reset()
    assert s.state.n_tokens == 0 and [t.data_ptr() for t in s.state.layers[2].tensors()] == buffers
    s.sync(prompt)
    np.testing.assert_allclose(s.eval(7).numpy(), first.numpy(), atol=1e-5)


@pytest.mark.cuda
def test_cuda_decode_replays_are_repeatable(official_gguf):
    """The same decode steps from the same states twice, batched (the pool's bucket graphs, 8 sessions at
    different depths) and alone (the single-state graph): bit-identical logits at every step. A step has no
    float atomics and sums split-K partials in a fixed order, so a difference means a race (a kernel reading
    before its inputs are visible, e.g. under dispatch.PDL_EARLY: run this with DS4_PDL_EARLY=1 as well)."""
    model = _cached_cuda(official_gguf)
    V = model.cfg.n_vocab
    pool = model.new_states(9, 160)
    live = pool[:8]
    for i, st in enumerate(live):  # 20 .. 83 tokens: window wraps, ratio-4 / 32 rows, the indexer selecting
        model.forward(st, [(j * 31 + i * 7) % V for j in range(20 + 9 * i)])
    base = [st.clone() for st in live]
    first = [(i * 13) % V for i in range(8)]

    def batched() -> list[torch.Tensor]:
        for st, b in zip(live, base, strict=True):
            st.copy_from(b)
        toks, out = first, []
        for _ in range(6):
            lg = model.decode_batch(live, toks)
            out.append(lg.clone())
            toks = lg.argmax(-1).tolist()
        return out

    def alone() -> tuple[list[int], torch.Tensor]:
        st = base[7].clone()
        toks = model.decode_greedy(st, first[7], 6).tolist()
        return toks, st._runner.logits.clone()

    a, b = batched(), batched()
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    (ta, la), (tb, lb) = alone(), alone()
    assert ta == tb and torch.equal(la, lb)


def test_step_memo_shares_ring_rows_within_one_step_only() -> None:
    """layer.ring_and_count inside step_memo(): one computation per (window, ratio) for all layers of a step,
    the same values as computed alone; a new step (a new graph body) computes afresh."""
    from ds4.model.cuda import layer

    slot, pos = torch.tensor([0, 2]), torch.tensor([5, 300])
    alone = layer.ring_and_count(slot, pos, 128, 4)
    assert alone[0].tolist() == [5, 2 * 128 + 300 % 128] and alone[1].tolist() == [1, 75]
    with layer.step_memo():
        a = layer.ring_and_count(slot, pos, 128, 4)
        b = layer.ring_and_count(slot, pos, 128, 4)
        c = layer.ring_and_count(slot, pos, 128, 128)
        assert a[0] is b[0] and a[1] is b[1] and c[1] is not a[1]
        assert torch.equal(a[0], alone[0]) and torch.equal(a[1], alone[1]) and c[1].tolist() == [0, 2]
    with layer.step_memo():
        assert layer.ring_and_count(slot, pos, 128, 4)[0] is not a[0]
    assert layer.ring_and_count(slot, pos, 128, 4)[0] is not a[0]
