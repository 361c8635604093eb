"""CudaModel.decode_batch (issue 8) on the CPU device: B sessions of one KV pool decoded together equal each
session decoded alone through the single-state path (forward(state, [tok])), state buffers included.

Sessions sit at different positions so one step mixes: a raw-window wrap, ratio-4 window completions, the
indexer selecting its top-k (more than top-k rows visible), a ratio-128 (synthetic) / ratio-32 (official)
row completion. The oracle is the single-session device path, checked elsewhere against the official logits
and the CPU reference (tests/test_cuda_backend.py); the batched path is separate code (ds4.model.cuda.batch).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from _roundtrips import round_trips_off
from conftest import OFFICIAL_TINY

from ds4.config import FLASH, TINY
from ds4.gguf import open_model
from ds4.model.cuda import CudaModel, gguf_source
from ds4.model.cuda.state import DeviceKVState, KVPool, session_nbytes

LOGIT_TOL = 1e-4  # float32 both ways: only the GEMM row blocking differs
STATE_TOL = 5e-5  # frontier scores reach ~|10|: a few float32 ulps


def _model(path, **kw) -> CudaModel:
    torch.set_num_threads(1)
    mf = open_model(path)
    return CudaModel(mf.config, gguf_source(mf), has=mf.has, device="cpu", **kw)


@pytest.fixture(scope="module")
def tiny_model() -> CudaModel:
    pytest.importorskip("gguf", reason="building the tiny model file needs gguf (absent on the GPU machine)")
    from ds4.tools.make_model import ensure_tiny_model

    return _model(ensure_tiny_model())


def _buffers(state: DeviceKVState) -> list[torch.Tensor]:
    return [t.clone() for layer in state.layers for t in layer.tensors()]


def _assert_states_close(a: DeviceKVState, b: DeviceKVState) -> None:
    assert a.n_tokens == b.n_tokens
    for x, y in zip(_buffers(a), _buffers(b), strict=True):
        torch.testing.assert_close(x, y, atol=STATE_TOL, rtol=1e-5)


def _check_batch_equals_alone(
    model: CudaModel, lengths: list[int], steps: int, seed: int, close: bool = True
) -> None:
    """Pool of len(lengths) + 1 sessions; the last one (a short prompt) idles: its buffers must not move.
    With `close`, logits and state buffers within float32 noise too (not only the greedy tokens)."""
    cfg = model.cfg
    gen = torch.Generator().manual_seed(seed)
    ctx = max(lengths) + steps + 2
    pool = model.new_states(len(lengths) + 1, ctx)
    live, idle = pool[:-1], pool[-1]
    model.forward(idle, [5, 6, 7])
    idle_before = _buffers(idle)
    logits = []
    for st, n in zip(live, lengths, strict=True):
        logits.append(model.forward(st, torch.randint(0, cfg.n_vocab, (n,), generator=gen).tolist()))
    alone = [st.clone() for st in live]  # independent states (own buffers) with the same history
    assert all(a.pool is None for a in alone)
    toks = [int(lg.argmax()) for lg in logits]
    worst = 0.0
    for _ in range(steps):
        got = model.decode_batch(live, toks)  # [B, V]
        want = torch.stack([model.forward(a, [t]) for a, t in zip(alone, toks, strict=True)])
        assert got.shape == (len(lengths), cfg.n_vocab)
        assert got.argmax(-1).tolist() == want.argmax(-1).tolist()
        worst = max(worst, float((got - want).abs().max()))
        toks = want.argmax(-1).tolist()
    print(f"decode_batch vs alone, B={len(lengths)}: max |dlogit| {worst:.2e}")
    if close:
        assert worst <= LOGIT_TOL
        for a, b in zip(alone, live, strict=True):
            _assert_states_close(a, b)
    assert idle.n_tokens == 3
    for x, y in zip(idle_before, _buffers(idle), strict=True):
        assert torch.equal(x, y), "a batched step wrote into an idle slot"


def test_tiny_synthetic_batch_equals_alone(tiny_model):
    c = tiny_model.cfg  # window 32, ratios 4 / 128, indexer top-k 8
    assert (c.window, c.indexer_topk) == (32, 8) and 128 in c.compress_ratios
    # 3 live (+1 idle) rows -> bucket 4: no padding; window wrap at 32, indexer selecting (>8 rows at 45),
    # a ratio-128 row completed at position 127
    _check_batch_equals_alone(tiny_model, [30, 45, 124], steps=4, seed=1)


@pytest.mark.parametrize("round_trips", [True, False], ids=["round-trips", "no-round-trips"])
def test_official_tiny_batch_equals_alone(official_gguf, monkeypatch, round_trips: bool):
    """With the FP8 / FP4 round trips on, the greedy tokens agree; logits and states within float32 noise are
    checked with them off (tests/_roundtrips.py: on the device host's CPU a summation-order ulp before a
    round trip moved a logit by 2e-4)."""
    calls = None if round_trips else round_trips_off(monkeypatch)
    model = _model(official_gguf)  # window 16, ratios 4 / 32, indexer top-k 8
    # 4 live rows (+1 idle) -> bucket 4; 2 live -> bucket 2 below; a 1-token session; ratio-32 rows at 31, 63
    _check_batch_equals_alone(model, [1, 14, 29, 60], steps=5, seed=2, close=not round_trips)
    assert calls is None or (calls["fp8"] > 0 and calls["fp4"] > 0), f"a round trip was not live: {calls}"


def test_padded_rows_hit_only_the_scratch_slot(tiny_model):
    """3 sessions -> bucket 4: the padded row runs on the scratch slot; the other slots do not move."""
    m = tiny_model
    pool = m.new_states(5, 48)
    for i, st in enumerate(pool):
        m.forward(st, [10 + i, 20 + i, 30 + i])
    before = [_buffers(st) for st in pool]
    scratch = [t.clone() for layer in pool[0].pool.layers for t in layer.tensors()]
    m.decode_batch([pool[3], pool[0], pool[4]], [1, 2, 3])
    assert pool[0].pool.runner.buckets.keys() == {(4, None)}
    for i in (1, 2):
        assert all(torch.equal(x, y) for x, y in zip(before[i], _buffers(pool[i]), strict=True))
    for i in (0, 3, 4):
        assert not all(torch.equal(x, y) for x, y in zip(before[i], _buffers(pool[i]), strict=True))
    after = [t for layer in pool[0].pool.layers for t in layer.tensors()]
    assert any(not torch.equal(x[-1], y[-1]) for x, y in zip(scratch, after, strict=True))  # pad row ran


def test_reset_restore_copy_in_place_stay_consistent(tiny_model):
    """Pool states reset, copied (copy_from) and restored (to_cpu / load_cpu) in place keep decoding in the
    batch exactly like fresh single states with the same history."""
    m = tiny_model
    a, b, c = m.new_states(3, 64)
    m.forward(a, list(range(100, 140)))
    m.forward(b, list(range(200, 210)))
    m.decode_batch([a, b], [1, 2])
    ptrs = [t.data_ptr() for layer in b.layers for t in layer.tensors()]
    b.reset()
    assert b.n_tokens == 0
    m.forward(b, list(range(300, 320)))
    c.copy_from(a)  # the bench's trick: one prefill, many sessions
    a.load_cpu(a.to_cpu())  # snapshot round trip in place
    assert [t.data_ptr() for layer in b.layers for t in layer.tensors()] == ptrs
    ref_b = m.new_state(64)
    m.forward(ref_b, list(range(300, 320)))
    ref_a = m.new_state(64)
    m.forward(ref_a, list(range(100, 140)))
    m.forward(ref_a, [1])
    for tok in (7, 8):
        got = m.decode_batch([a, b, c], [tok, tok, tok])
        wa, wb = m.forward(ref_a, [tok]), m.forward(ref_b, [tok])
        torch.testing.assert_close(got[0], wa, atol=LOGIT_TOL, rtol=0)
        torch.testing.assert_close(got[1], wb, atol=LOGIT_TOL, rtol=0)
        torch.testing.assert_close(got[2], got[0], atol=0, rtol=0)  # c is a's twin
    _assert_states_close(ref_a, a)
    _assert_states_close(ref_b, b)


def test_decode_batch_rejects_bad_input(tiny_model):
    m = tiny_model
    a, b = m.new_states(2, 4)
    (other,) = m.new_states(1, 4)
    with pytest.raises(ValueError, match="one token per state"):
        m.decode_batch([a, b], [1])
    with pytest.raises(ValueError, match="same state twice"):
        m.decode_batch([a, a], [1, 2])
    with pytest.raises(ValueError, match="one pool"):
        m.decode_batch([a, other], [1, 2])
    with pytest.raises(ValueError, match="one pool"):
        m.decode_batch([a, m.new_state(4)], [1, 2])
    with pytest.raises(ValueError, match="out of range"):
        m.decode_batch([a, b], [1, m.cfg.n_vocab])
    m.forward(a, [1, 2, 3, 4])
    with pytest.raises(ValueError, match="context overflow"):
        m.decode_batch([a, b], [1, 2])
    assert (a.n_tokens, b.n_tokens) == (4, 0)


@pytest.mark.parametrize("cfg", [TINY, replace(FLASH, n_layer=8, compress_ratios=FLASH.compress_ratios[:8])])
@pytest.mark.parametrize("ctx", [64, 8192])
def test_session_nbytes_is_exact(cfg, ctx):
    one = DeviceKVState(cfg, ctx, "meta").nbytes()
    assert session_nbytes(cfg, ctx) == one
    assert KVPool(cfg, 3, ctx, "meta").nbytes() == 4 * one  # 3 slots + scratch


def test_pool_states_are_views_of_one_allocation(tiny_model):
    states = tiny_model.new_states(3, 32)
    pool = states[0].pool
    assert [s.slot for s in states] == [0, 1, 2] and all(s.pool is pool for s in states)
    raw = pool.layers[0].raw
    assert raw.shape[0] == 4
    assert states[2].layers[0].raw.data_ptr() == raw[2].data_ptr()


@pytest.mark.skipif(not (OFFICIAL_TINY / "model.gguf.xz").exists(), reason="no official fixture")
def test_cpu_model_new_states(official_gguf):
    from _gguf_model import load_model

    model = load_model(official_gguf)
    states = model.new_states(3, 16)
    assert len(states) == 3 and len({id(s) for s in states}) == 3 and all(s.ctx == 16 for s in states)


def test_scheduler_drives_the_device_model(tiny_model):
    """ds4.engine.Scheduler over ModelBackend(CudaModel, slots=N): concurrent greedy streams equal each
    stream alone; snapshot/restore and reset work in place on the pool sessions."""
    from ds4.engine.batch_backend import ModelBackend
    from ds4.engine.scheduler import Finished, Request, Scheduler, Started

    m, steps = tiny_model, 3
    gen = torch.Generator().manual_seed(5)
    lengths = [3, 12, 7]
    prompts = [torch.randint(0, m.cfg.n_vocab, (n,), generator=gen).tolist() for n in lengths]
    ctx = max(lengths) + steps + 2
    want = []
    for p in prompts:
        st, out = m.new_state(ctx), []
        lg = m.forward(st, p)
        for _ in range(steps):
            out.append(int(lg.argmax()))
            lg = m.forward(st, [out[-1]])
        want.append(out)

    events: list = []
    backend = ModelBackend(m, ctx, slots=4)
    sched = Scheduler(
        backend,
        sampler=lambda req, lg: int(lg.argmax()),
        on_event=events.append,
        slots=3,
        prefill_budget=32,
        ctx=ctx,
    )
    for i, p in enumerate(prompts):
        sched.submit(Request(f"r{i}", p, max_tokens=steps))
    sched.run()
    fin = {e.request_id: e for e in events if isinstance(e, Finished)}
    assert [list(fin[f"r{i}"].tokens) for i in range(3)] == want
    assert len({id(s.session.state.pool) for s in sched.slots}) == 1  # one pool

    slot = next(e.slot for e in events if isinstance(e, Started) and e.request_id == "r1")
    s2 = sched.slots[slot].session
    other = backend.new_session()  # the 4th preallocated session
    with pytest.raises(ValueError, match="in use"):
        backend.new_session()
    ptrs = [t.data_ptr() for t in other.state.layers[2].tensors()]
    backend.restore(other, backend.snapshot(s2))
    assert other.tokens == s2.tokens and other.state.n_tokens == s2.state.n_tokens
    a, b = backend.decode_batch([s2, other], [3, 3])
    assert float((a - b).abs().max()) == 0.0
    backend.reset(other)
    assert other.state.n_tokens == 0 and other.tokens == []
    assert [t.data_ptr() for t in other.state.layers[2].tensors()] == ptrs


def test_kernel_dispatch_path_batch_equals_alone(monkeypatch):
    """kernels=True on the CPU: packed Q8_0 QLinear (qmatvec / grouped o_a for <= 8 rows) and PackedWeight
    experts through ds4.kernels' torch twins; the routed experts both as gathered-expert kernels and as
    grouped GEMMs over the pairs sorted by expert (batch.GROUPED_ROWS)."""
    from ds4.kernels import moe as kmoe
    from ds4.model.cuda import batch
    from ds4.model.cuda.weights import QLinear

    pytest.importorskip("gguf", reason="building the tiny model file needs gguf (absent on the GPU machine)")
    # the f32 expert kernels' twins: the default integer ones quantize their activations, so an ulp of
    # difference between batched and single summation orders can move a value by a quantization step
    # (then an FP8 step of a KV row); that math has its own tests (test_kernels_moe.py)
    monkeypatch.setattr(kmoe, "GATE_UP", kmoe.MoeConfig(bn=8, splits=1))
    monkeypatch.setattr(kmoe, "DOWN", kmoe.MoeConfig(bn=32, splits=1))
    from ds4.tools.make_model import ensure_tiny_model

    m = _model(ensure_tiny_model(), kernels=True)
    assert isinstance(m.layers[0].w.attn.out_a, QLinear)
    live = m.new_states(2, 48)
    # (a 5-token prompt left, with the prefill's HC kernels, a state whose next step sits on a quantization
    # boundary: batch and alone differed by one rounding step there, 7e-4, every other length 3..12 < 5e-6)
    for st, n in zip(live, (12, 7), strict=True):
        m.forward(st, [(i * 7919 + n) % m.cfg.n_vocab for i in range(n)])
    alone = [st.clone() for st in live]
    for grouped, tok in ((0, 3), (1, 4)):
        monkeypatch.setattr(batch, "GROUPED_ROWS", grouped)
        got = m.decode_batch(live, [tok, tok])
        want = torch.stack([m.forward(a, [tok]) for a in alone])
        diff = float((got - want).abs().max())
        print(f"kernel path, grouped experts {bool(grouped)}: max |dlogit| {diff:.2e}")
        assert diff <= LOGIT_TOL
    for a, b in zip(alone, live, strict=True):
        _assert_states_close(a, b)
    # more than DECODE_ROWS rows, up to BATCH_QROWS: the packed blocks at f32 accuracy (the dense copy is
    # bf16 on Flash), shown by a dense copy that is wrong; above BATCH_QROWS (or with it 0): the dense copy
    from ds4.model.cuda import layer

    q = m.layers[0].w.attn.q_a
    x = torch.randn(12, q.dense.shape[1], generator=torch.Generator().manual_seed(3))
    want = x @ q.dense.float().T
    wrong = QLinear(torch.zeros_like(q.dense), q.packed)
    assert layer.BATCH_QROWS >= 12
    torch.testing.assert_close(layer.lin(x, wrong), want, atol=1e-5 * float(want.abs().max()), rtol=0)
    monkeypatch.setattr(layer, "BATCH_QROWS", 0)
    assert torch.equal(layer.lin(x, q), torch.nn.functional.linear(x, q.dense))
    assert not layer.lin(x, wrong).any()


def test_merged_rows_read_by_one_launch_up_to_merged_rows(monkeypatch):
    """layer.MERGED_ROWS: a batched step of 12 rows (> DECODE_ROWS) reads q_a + kv and the shared expert's
    gate + up through their merged packed matrices (one qmatvec each) when it allows 12 rows, one matvec
    per matrix otherwise; the logits agree within float32 noise (kernels=True on the CPU: the twins)."""
    from ds4.model.cuda import layer

    pytest.importorskip("gguf", reason="building the tiny model file needs gguf (absent on the GPU machine)")
    from ds4.tools.make_model import ensure_tiny_model

    m = _model(ensure_tiny_model(), kernels=True)
    sides = [blk.side for blk in m.layers]
    assert all(sd is not None and sd.qa_kv is not None and sd.shared_gu is not None for sd in sides)
    merged = {id(w) for sd in sides for w in (sd.qa_kv, sd.shared_gu)}
    pool = m.new_states(12, 40)
    for i, st in enumerate(pool):
        m.forward(st, [(j * 7919 + i) % m.cfg.n_vocab for j in range(5 + i)])
    base = [st.clone() for st in pool]
    seen: list[int] = []
    real = layer.qmatvec
    monkeypatch.setattr(layer, "qmatvec", lambda x, w, *a: (seen.append(id(w)), real(x, w, *a))[1])
    out = {}
    for rows in (layer.DECODE_ROWS, 64):
        monkeypatch.setattr(layer, "MERGED_ROWS", rows)
        for st, b in zip(pool, base, strict=True):
            st.copy_from(b)
        pool[0].pool.runner = None  # a new step under the switch in force
        seen.clear()
        out[rows] = m.decode_batch(pool, [3 + i for i in range(12)])
        out[rows, "merged"] = sum(w in merged for w in seen)
    assert out[layer.DECODE_ROWS, "merged"] == 0
    assert out[64, "merged"] == 2 * m.cfg.n_layer  # q_a + kv and gate + up, every layer
    torch.testing.assert_close(out[64], out[layer.DECODE_ROWS], atol=LOGIT_TOL, rtol=0)


def test_one_session_through_the_bucket_1_step(tiny_model, monkeypatch):
    """decode_batch of one session: the single-state graph by default, the pool's bucket 1 with
    BATCH1_SINGLE off; both equal forward(state, [tok])."""
    from ds4.model.cuda import model as cuda_model

    m = tiny_model
    pool = m.new_states(2, 48)
    m.forward(pool[1], list(range(500, 541)))
    alone = pool[1].clone()
    for single, tok in ((True, 4), (False, 5)):
        monkeypatch.setattr(cuda_model, "BATCH1_SINGLE", single)
        got = m.decode_batch([pool[1]], [tok])
        torch.testing.assert_close(got[0], m.forward(alone, [tok]), atol=LOGIT_TOL, rtol=0)
    assert set(pool[1].pool.runner.buckets) == {(1, None)}
    _assert_states_close(alone, pool[1])


# ---- context buckets (model.ctx_bound / layer.indexer_width) ---------------------------------------------


def test_ctx_bound_buckets(monkeypatch):
    from ds4.model.cuda import model as cm

    monkeypatch.setattr(cm, "CTX_BUCKETS", False)
    assert cm.ctx_bound(10, 1 << 20) is None
    monkeypatch.setattr(cm, "CTX_BUCKETS", True)
    m = cm.CTX_BUCKET_MIN
    assert cm.ctx_bound(1, 1 << 20) == m
    assert cm.ctx_bound(m, 1 << 20) == m
    assert cm.ctx_bound(m + 1, 1 << 20) == 2 * m
    assert cm.ctx_bound(m + 1, 2 * m) is None  # the bucket covers the allocation: no bound
    for tokens in (1, 77, m - 1, 3 * m + 5):
        assert tokens <= cm.ctx_bound(tokens, 1 << 24) < 2 * max(tokens, m)


def test_indexer_width():
    from ds4.model.cuda.layer import indexer_width

    assert indexer_width(2048, 512, 4, None) == 2048
    assert indexer_width(2048, 512, 4, 4096) == 1024
    assert indexer_width(2048, 512, 4, 1024) == 512  # never fewer than k
    assert indexer_width(2048, 512, 4, 1 << 20) == 2048  # never more than cap


def _greedy_logits(model, bucketed: bool, monkeypatch, batched: bool) -> list[torch.Tensor]:
    from ds4.model.cuda import model as cm

    monkeypatch.setattr(cm, "CTX_BUCKETS", bucketed)
    monkeypatch.setattr(cm, "CTX_BUCKET_MIN", 32)  # tiny contexts: buckets of 32, 64, 128 tokens
    gen = torch.Generator().manual_seed(5)
    pool = model.new_states(3, 256)
    lengths = [40, 55, 9]
    logits = [model.forward(st, torch.randint(0, model.cfg.n_vocab, (n,), generator=gen).tolist())
              for st, n in zip(pool, lengths, strict=True)]  # fmt: skip
    toks = [int(lg.argmax()) for lg in logits]
    out = []
    for _ in range(12):  # crosses the 64-token bucket
        got = model.decode_batch(pool, toks) if batched else torch.stack(
            [model.forward(st, [t]) for st, t in zip(pool, toks, strict=True)]
        )  # fmt: skip
        out.append(got)
        toks = got.argmax(-1).tolist()
    return out


@pytest.mark.parametrize("batched", [False, True], ids=["alone", "batched"])
def test_ctx_buckets_change_no_logit(official_gguf, monkeypatch, batched: bool):
    """Sessions of ctx 256 (64 ratio-4 rows, top-k 8) decoded with the indexer ranking only the rows below
    the step's bucket equal the full ranking bit for bit; a bound below the sessions' depth does not (the
    bound is live)."""
    from ds4.model.cuda import model as cm

    model = _model(official_gguf)
    want = _greedy_logits(model, False, monkeypatch, batched)
    got = _greedy_logits(model, True, monkeypatch, batched)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)
    monkeypatch.setattr(cm, "ctx_bound", lambda tokens, ctx: 40)  # 10 rows ranked; sessions reach 16
    wrong = _greedy_logits(model, True, monkeypatch, batched)
    assert any(not torch.equal(a, b) for a, b in zip(wrong, want, strict=True))


# ---- graph capture warm-up (DeviceKVState.step_restorer) --------------------------------------------------


def _visible(state: DeviceKVState) -> list[torch.Tensor]:
    """What a snapshot of the state holds (DeviceKVState.to_cpu)."""
    fields = ("raw", "comp", "comp_kv", "comp_score", "index", "index_kv", "index_score")
    layers = state.to_cpu().layers
    return [t for kv in layers for t in (getattr(kv, f) for f in fields) if t is not None]


@pytest.mark.parametrize("which", ["official", "synthetic"])
def test_warm_up_step_restored_then_replayed_equals_one_step(which, official_gguf, tiny_model):
    """A decode graph's capture runs the step once for real (warm-up) and puts back only what
    step_restorer saved; the replay must then equal the step run once, bit for bit (logits, every buffer),
    and between the two the state must snapshot as before the step. Positions cross window wraps,
    ratio-4 / 32 / 128 row completions and the indexer selecting. Without the restore, it does not hold."""
    model = _model(official_gguf) if which == "official" else tiny_model
    V, steps = model.cfg.n_vocab, (45 if which == "official" else 130)  # to 49 / 134: past 36 / 127
    st = model.new_state(200)
    model.forward(st, [(j * 31) % V for j in range(5)])
    unrestored_differs = False
    with torch.inference_mode():
        for _ in range(steps):
            p = st.n_tokens
            tok, pos = torch.tensor([(p * 7919 + 3) % V]), torch.tensor([p])
            once = st.clone()
            want = model.decode_step(once, tok, pos)
            before = _visible(st)
            if not unrestored_differs:  # the step twice without restoring anything
                twice = st.clone()
                model.decode_step(twice, tok, pos)
                unrestored_differs = not torch.equal(model.decode_step(twice, tok, pos), want) or any(
                    not torch.equal(a, b) for a, b in zip(_buffers(twice), _buffers(once), strict=True)
                )
            restore = st.step_restorer(pos)
            model.decode_step(st, tok, pos)  # the warm-up
            restore()
            assert all(torch.equal(a, b) for a, b in zip(_visible(st), before, strict=True)), p
            assert torch.equal(model.decode_step(st, tok, pos), want), p  # the replay
            assert all(torch.equal(a, b) for a, b in zip(_buffers(st), _buffers(once), strict=True)), p
            st.n_tokens = p + 1
    assert unrestored_differs


@pytest.mark.parametrize("batched", [False, True], ids=["single", "batched"])
def test_hc_post_mix_changes_no_logit(tiny_model, monkeypatch, batched: bool):
    """fused.HC_POST_MIX: each HC post hands the next HC site its mixing partials (the torch twins here):
    the same logits as the separate projection within float32 noise, the same states."""
    from ds4.model.cuda import fused

    assert fused.TRITON_FUSED  # the kernel wiring with its CPU twins
    out = {}
    for on in (False, True):
        monkeypatch.setattr(fused, "HC_POST_MIX", on)
        states = tiny_model.new_states(2, 40)
        for st, n in zip(states, (21, 9), strict=True):
            tiny_model.forward(st, [(i * 31 + n) % tiny_model.cfg.n_vocab for i in range(n)])
        picked = states if batched else states[:1]  # one session: the single-state step (decode_step)
        out[on] = (tiny_model.decode_batch(picked, [5, 6][: len(picked)]), states)
    got, want = out[True][0], out[False][0]
    assert float((got - want).abs().max()) <= LOGIT_TOL * float(want.abs().max())
    for a, b in zip(out[True][1], out[False][1], strict=True):
        _assert_states_close(a, b)


def test_prefetch_sites_request_each_layers_weights(tiny_model, monkeypatch):
    """layer.PREFETCH: each decode layer asks prefetch_l2 for its own static weights at the three sites (q_a,
    kv, q_b / o_a, o_b / the shared expert and router) within the site's budget, and the step's logits do
    not change (on the CPU prefetch_l2 launches nothing; here a recorder stands in for it)."""
    from ds4.model.cuda import layer

    calls: list[tuple[list[torch.Tensor], int]] = []
    monkeypatch.setattr(layer, "prefetch_l2", lambda ts, budget: calls.append((ts, budget)) or 0)
    out = {}
    for sites in ({}, {"attn": 3, "o": 2, "ffn": 1}):
        monkeypatch.setattr(layer, "PREFETCH", sites)
        states = tiny_model.new_states(2, 40)
        for st, n in zip(states, (21, 9), strict=True):
            tiny_model.forward(st, [(i * 31 + n) % tiny_model.cfg.n_vocab for i in range(n)])
        calls.clear()
        out[bool(sites)] = tiny_model.decode_batch(states, [5, 6])
    assert torch.equal(out[True], out[False])
    n_layers = len(tiny_model.layers)
    assert len(calls) == 3 * n_layers
    for i, blk in enumerate(tiny_model.layers):
        (attn, b1), (o, b2), (ffn, b3) = calls[3 * i : 3 * i + 3]
        a, m = blk.w.attn, blk.w.moe
        assert (b1, b2, b3) == (3 << 20, 2 << 20, 1 << 20)
        assert [t.data_ptr() for t in attn] == [a.q_a.data_ptr(), a.kv.data_ptr(), a.q_b.data_ptr()]
        assert [t.data_ptr() for t in o] == [a.out_a.data_ptr(), a.out_b.data_ptr()]
        want = [m.gate_sh.data_ptr(), m.up_sh.data_ptr(), m.down_sh.data_ptr()]
        assert [t.data_ptr() for t in ffn] == want
    with pytest.raises(ValueError, match="DS4_PREFETCH"):
        layer._parse_prefetch("o=36,head=4")
    assert layer._parse_prefetch(" attn=42 , o=36") == {"attn": 42, "o": 36}


@pytest.mark.parametrize("scales", ["f32", "f32t"])
def test_rows_scale_copies_packed_at_load_and_merged(monkeypatch, scales):
    """With q8_rows switched to an f32 scale copy (matvec.Q8RowsConfig.scales), the model packs every Q8_0
    matrix's copy at load, so the copies are in weight_bytes (exactly twice the f16 scales' bytes), not in
    the bytes the bench counts for a batch-1 step, and no graph capture allocates them; the merged matrices
    (q_a + kv, shared gate + up) hold their parts' copies, and each part's copy is its own rows of the
    merged one."""
    from ds4.bench import decode_bytes_per_token
    from ds4.kernels import matvec

    pytest.importorskip("gguf", reason="building the tiny model file needs gguf (absent on the GPU machine)")
    from ds4.tools.make_model import ensure_tiny_model

    path = ensure_tiny_model()
    tiles = matvec.rows_tiles()
    for tile, cfg in tiles.items():  # the packed f16 scales only: no copy
        monkeypatch.setattr(matvec, tile, replace(cfg, scales="f16"))
    plain = _model(path, kernels=True)
    assert not any(k.startswith("d32") for q in _qlinears(plain) for k in q.packed.data)
    for tile, cfg in tiles.items():
        monkeypatch.setattr(matvec, tile, replace(cfg, scales=scales))
    m = _model(path, kernels=True)
    key = {"f32": "d32", "f32t": "d32t"}[scales]
    q8 = [q.packed for q in _qlinears(m) if q.packed.qtype.name == "Q8_0"]
    assert q8 and all(key in w.data for w in q8)
    f16_bytes = sum(w.data["d"].numel() * 2 for w in q8)
    assert m.weight_bytes() - plain.weight_bytes() == 2 * f16_bytes  # f32: twice the f16 scales' bytes
    assert decode_bytes_per_token(m) == decode_bytes_per_token(plain)  # a batch-1 step reads no copy
    for w in q8:
        d = w.data["d"].reshape(w.rows, -1).float()
        assert torch.equal(w.data[key].t() if scales == "f32t" else w.data[key], d)
    for sd in (blk.side for blk in m.layers):
        for merged in (sd.qa_kv, sd.shared_gu):
            d = merged.data["d"].reshape(merged.rows, -1).float()
            assert torch.equal(merged.data[key].t() if scales == "f32t" else merged.data[key], d)


def _qlinears(m: CudaModel) -> list:
    """Every QLinear of the model's layers and head (one level of attribute nesting, as the weights hold)."""
    from ds4.model.cuda.weights import QLinear

    out = [m.output] if isinstance(m.output, QLinear) else []
    for blk in m.layers:
        for part in vars(blk.w).values():
            for v in [part, *getattr(part, "__dict__", {}).values()]:
                if isinstance(v, QLinear):
                    out.append(v)
    return out
