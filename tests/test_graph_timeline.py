"""tools/gpu/graph_timeline.py's trace reading and step figures, on hand-made traces (no GPU): kernels are
taken by their graph launch's correlation id; the union, the idle time and each kernel's share of the chain
of ends (excl, gap) come out as the intervals say."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools" / "gpu"))
import graph_timeline as gt  # noqa: E402


def _kernel(name, stream, ts, dur, corr):
    args = {"stream": stream, "correlation": corr}
    return {"cat": "kernel", "name": name, "ts": ts, "dur": dur, "args": args}


def _launch(ts, corr):
    return {"cat": "cuda_runtime", "name": "cudaGraphLaunch", "ts": ts, "args": {"correlation": corr}}


def test_graph_kernels_groups_by_launch_and_drops_eager_kernels():
    trace = {
        "traceEvents": [
            _launch(200.0, 9),
            _launch(100.0, 7),
            _kernel("b", 7, 130.0, 5.0, 7),
            _kernel("a", 7, 110.0, 5.0, 7),
            _kernel("eager", 7, 50.0, 5.0, 3),  # no graph launch of that id: not a replay's
            _kernel("c", 7, 210.0, 5.0, 9),
        ]
    }
    steps = gt.graph_kernels(trace)
    assert [[k.name for k in s] for s in steps] == [["a", "b"], ["c"]]
    assert steps[0][0].end == 115.0


def test_union_length_merges_overlaps_only():
    assert gt.union_length([(0, 10), (5, 12), (20, 25)]) == 17
    assert gt.union_length([(3, 4)]) == 1
    assert gt.union_length([]) == 0


def test_analyze_charges_each_end_the_time_since_the_previous_end():
    K = gt.Kernel
    kernels = [
        K("mv", 1, 0.0, 10.0, 1),
        K("mv", 1, 8.0, 15.0, 1),  # PDL: started before its predecessor ended; charged 5
        K("side", 2, 9.0, 14.0, 1),  # ends first of the two: charged 14 - 10
        K("norm", 1, 20.0, 22.0, 1),  # 5 us gap before it
        K("tail", 1, 31.0, 33.0, 1),  # 9 us gap
    ]
    s = gt.analyze(kernels)
    assert s.n_kernels == 5 and s.n_streams == 2
    assert s.span == 33.0
    assert s.busy == 19.0  # [0, 15], [20, 22], [31, 33]
    assert s.idle == 14.0
    assert s.names["mv"] == [2, 17.0, 11.0, 0.0]  # 10, then 15 - 14
    assert s.names["side"] == [1, 5.0, 4.0, 0.0]
    assert s.names["norm"] == [1, 2.0, 2.0, 5.0]
    assert s.names["tail"] == [1, 2.0, 2.0, 9.0]
    assert sum(r[2] + r[3] for r in s.names.values()) == pytest.approx(s.span)


def test_analyze_refuses_an_empty_step():
    with pytest.raises(ValueError):
        gt.analyze([])


def test_step_callables_drive_the_runners_without_moving_the_sessions():
    """_single_steps / _batch_steps on the tiny model (CPU device: the eager bodies the graphs capture): each
    call runs a whole step at the same position (the work of a decode step; no session's token count moves),
    the batched one with a distinct token per session."""
    pytest.importorskip("gguf", reason="building the tiny model file needs gguf")
    import torch

    from ds4.gguf import open_model
    from ds4.model.cuda import CudaModel, gguf_source
    from ds4.tools.make_model import ensure_tiny_model

    mf = open_model(ensure_tiny_model())
    model = CudaModel(mf.config, gguf_source(mf), has=mf.has, device="cpu")
    with torch.inference_mode():
        single = model.new_state(64)
        first = int(model.forward(single, list(range(1, 20))).argmax())
        runner = model.runner(single)
        runner.logits.fill_(float("nan"))
        gt._single_steps(model, 4, first, single)()
        assert bool(torch.isfinite(runner.logits).all()) and single.n_tokens == 19
        assert int(runner.token) == first and int(runner.pos) == 19
        pool = model.new_states(3, 64)
        model.forward(pool[0], list(range(1, 20)))
        for st in pool[1:]:
            st.copy_from(pool[0])
        got = gt._batch_steps(model, pool, first)()
    assert got.shape == (3, model.cfg.n_vocab) and bool(torch.isfinite(got).all())
    assert not torch.equal(got[0], got[1])  # distinct tokens per session
    assert [st.n_tokens for st in pool] == [19, 19, 19]
