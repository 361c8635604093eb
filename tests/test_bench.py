"""ds4-bench: frontier schedule, argument checks, a tiny CPU sweep whose rows are checked independently."""

from __future__ import annotations

import csv

import pytest
from conftest import BENCH_TEXT

from ds4 import bench
from ds4.engine.snapshot import payload_size


def test_frontiers_incr_and_mul():
    assert bench.frontiers(2048, 8192, 2048, 1.0) == [2048, 4096, 6144, 8192]
    assert bench.frontiers(2048, 7000, 2048, 1.0) == [2048, 4096, 6144, 7000]  # last row at ctx-max
    assert bench.frontiers(100, 400, 0, 2.0) == [100, 200, 400]
    assert bench.frontiers(3, 5, 0, 1.1) == [3, 4, 5]  # ceil(f * mul) but at least f + 1
    assert bench.frontiers(64, 64, 2048, 1.0) == [64]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--ctx-start", "10", "--ctx-max", "5"], "ctx-start"),
        (["--step-mul", "0.5"], "step-mul"),
        (["--ctx-max", "100", "-n", "10", "--ctx-alloc", "110"], "ctx-alloc"),
        (["--plot"], "--csv"),
        (["--decode-at", "x"], "token counts"),
        (["--decode-at", "7", "-n", "2", "--repeats", "2"], "must exceed"),
        (["--decode-at", "100", "--parallel", "2"], "pick one"),
    ],
)
def test_bad_arguments(argv, message, capsys):
    with pytest.raises(SystemExit):
        bench.parse_args(argv)
    assert message in capsys.readouterr().err


def test_missing_prompt_file_is_a_clear_error(tmp_path, capsys):
    rc = bench.main(["-m", "tiny", "--cpu", "--prompt-file", str(tmp_path / "nope.txt")])
    assert rc == 2 and "prompt file not found" in capsys.readouterr().err


def test_tiny_cpu_sweep(tmp_path, capsys):
    """Three frontiers on the tiny model: one row each, intervals add up, KV bytes = §11.3 formula."""
    if not BENCH_TEXT.exists():
        pytest.skip(f"bench text missing: {BENCH_TEXT}")
    out = tmp_path / "b.csv"
    argv = ["-m", "tiny", "--cpu", "-t", "1", "--ctx-start", "16", "--ctx-max", "40", "--step-incr", "12"]
    rc = bench.main([*argv, "--gen-tokens", "3", "--csv", str(out), "--plot"])
    assert rc == 0
    with open(out, newline="") as fh:
        rows = list(csv.DictReader(fh))
    assert list(rows[0]) == bench.COLUMNS
    assert [int(r["ctx_tokens"]) for r in rows] == [16, 28, 40]
    assert [int(r["prefill_tokens"]) for r in rows] == [16, 12, 12]  # only the new interval is prefilled
    from ds4.config import TINY

    for r in rows:
        assert int(r["gen_tokens"]) == 3
        assert float(r["prefill_tps"]) > 0 and float(r["gen_tps"]) > 0 and float(r["weights_gbps"]) > 0
        assert int(r["kvcache_bytes"]) == payload_size(TINY, int(r["ctx_tokens"]))
    png = out.with_name("b_ts.png")
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert "matplotlib is not installed" in capsys.readouterr().err and not png.exists()
    else:
        assert png.exists() and png.with_suffix(".svg").exists()


def test_tiny_cpu_decode_at(tmp_path, capsys):
    """--decode-at: one row per listed context (sorted), at the fill depth the timed runs leave room for,
    nothing prefilled, KV bytes of that depth; the plot skips the empty prefill column."""
    if not BENCH_TEXT.exists():
        pytest.skip(f"bench text missing: {BENCH_TEXT}")
    out = tmp_path / "d.csv"
    argv = ["-m", "tiny", "--cpu", "-t", "1", "--decode-at", "300,100", "-n", "2", "--repeats", "2"]
    assert bench.main([*argv, "--csv", str(out), "--plot"]) == 0
    with open(out, newline="") as fh:
        rows = list(csv.DictReader(fh))
    from ds4.config import TINY

    assert [int(r["ctx_tokens"]) for r in rows] == [100 - 7, 300 - 7]  # C - 2 x (2 + 1) - 1
    for r in rows:
        assert int(r["prefill_tokens"]) == 0 and r["prefill_tps"] == "" and int(r["gen_tokens"]) == 2
        assert float(r["gen_tps"]) > 0 and float(r["weights_gbps"]) > 0
        assert int(r["kvcache_bytes"]) == payload_size(TINY, int(r["ctx_tokens"]))


def test_decode_at_fills_device_states():
    """fill_random on the device model's states (CudaModel on the CPU device): every buffer random, the
    position at the depth; the CPU reference's state gets ring / compressed / indexer rows of that depth's
    lengths; the decode then continues from there."""
    import torch
    from _gguf_model import load_model

    from ds4.gguf import open_model
    from ds4.model.cuda import CudaModel, gguf_source
    from ds4.tools.make_model import ensure_tiny_model

    torch.set_num_threads(1)
    mf = open_model(ensure_tiny_model())
    dev = CudaModel(mf.config, gguf_source(mf), has=mf.has, device="cpu")
    st = dev.new_state(200)
    bench.fill_random(st, 150, dev.cfg.window)
    assert st.n_tokens == 150
    assert all(float(t.abs().sum()) > 0 for layer in st.layers for t in layer.tensors())
    assert dev.decode_greedy(st, 3, 2).numel() == 2 and st.n_tokens == 152

    cpu = load_model(ensure_tiny_model())  # the CPU reference (DS4Model)
    cs = cpu.new_state(200)
    bench.fill_random(cs, 150, cpu.cfg.window)
    for layer in cs.layers:
        assert layer.raw.shape[0] == min(150, cpu.cfg.window)
        if layer.comp is not None:
            assert layer.comp.shape[0] == 150 // layer.ratio
        if layer.index is not None:
            assert layer.index.shape[0] == 150 // 4
    assert cpu.forward(cs, [3]).shape[-1] == cpu.cfg.n_vocab and cs.n_tokens == 151


def test_greedy_skips_eos():
    """The driver's greedy decode never picks EOS even when it has the largest logit."""
    import torch

    class Fake:
        cfg = None

        def __init__(self):
            self.fed = []

        def new_state(self, ctx):
            return SimpleState()

        def forward(self, state, tokens):
            self.fed += tokens
            out = torch.zeros(10)
            out[3], out[7] = 5.0, 4.0  # EOS (3) always on top
            return out

    class SimpleState:
        def clone(self):
            return self

    m = Fake()
    drv = bench.Driver(m, 100, eos=3)
    drv.extend([1, 2])
    assert drv.greedy(4) == [7, 7, 7, 7]


def test_tiny_cpu_parallel(tmp_path):
    """--parallel 3 on the tiny model: one row per frontier with the batched-decode and TTFT columns."""
    if not BENCH_TEXT.exists():
        pytest.skip(f"bench text missing: {BENCH_TEXT}")
    out = tmp_path / "p.csv"
    argv = ["-m", "tiny", "--cpu", "-t", "1", "--ctx-start", "20", "--ctx-max", "36", "--step-incr", "16"]
    argv += ["--parallel", "3", "--gen-tokens", "2", "--repeats", "1", "--ttft-prompt", "12"]
    assert bench.main([*argv, "--prefill-budget", "5", "--csv", str(out)]) == 0
    with open(out, newline="") as fh:
        rows = list(csv.DictReader(fh))
    assert list(rows[0]) == bench.PARALLEL_COLUMNS
    assert [int(r["ctx_tokens"]) for r in rows] == [20, 36]
    for r in rows:
        assert (int(r["parallel"]), int(r["gen_tokens"]), int(r["ttft_prompt"])) == (3, 2, 12)
        step, tps = float(r["step_ms"]), float(r["gen_tps_aggregate"])
        assert step > 0 and abs(tps - 3 * 1e3 / step) <= 0.02 * tps  # 3 tokens per step
        assert float(r["ttft_s"]) > 0 and float(r["ttft_first_s"]) > 0 and float(r["weights_gbps"]) > 0
        assert int(r["kv_pool_bytes"]) == 0  # CPU states: no device pool


def test_parallel_bad_arguments(capsys):
    with pytest.raises(SystemExit):
        bench.parse_args(["--parallel", "-1"])
    assert "--parallel" in capsys.readouterr().err
    a = bench.parse_args(["--parallel", "4", "--ctx-max", "4096", "-n", "16", "--ttft-prompt", "1000"])
    assert a.ctx_alloc > 4096 + 16 and a.ctx_alloc > 4096 + 2 + 4  # room for streams while the prompt fills


def test_parallel_on_the_device_model_code(tmp_path):
    """The --parallel driver over CudaModel (run on the CPU device): pool sessions, copy_from, the batched
    step and the scheduler's in-place restore; the pool holds N streams + the base + scratch."""
    import io

    import torch

    from ds4.gguf import open_model
    from ds4.model.cuda import CudaModel, gguf_source
    from ds4.model.cuda.state import session_nbytes
    from ds4.tools.make_model import ensure_tiny_model

    torch.set_num_threads(1)
    mf = open_model(ensure_tiny_model())
    model = CudaModel(mf.config, gguf_source(mf), has=mf.has, device="cpu")
    tokens = [(i * 7919) % model.cfg.n_vocab for i in range(64)]
    a = bench.parse_args(
        ["--ctx-start", "24", "--ctx-max", "24", "--parallel", "3", "-n", "2", "--repeats", "1"]
        + ["--ttft-prompt", "10", "--prefill-budget", "4"]
    )
    out = io.StringIO()
    rows = bench.run(a, out, bench.Loaded(model, tokens, eos=1, label="tiny device"))
    assert len(rows) == 1 and float(rows[0]["ttft_s"]) > 0 and float(rows[0]["gen_tps_aggregate"]) > 0
    assert rows[0]["kv_pool_bytes"] == 5 * session_nbytes(model.cfg, a.ctx_alloc)


def _scripted_sweep(tmp_path, monkeypatch, seconds: list[float], repeats: int) -> list[dict]:
    """The tiny sweep (frontiers 16, 28) with each pass's (prefill s, decode s) = the next of `seconds`."""
    if not BENCH_TEXT.exists():
        pytest.skip(f"bench text missing: {BENCH_TEXT}")
    real = bench._frontier_times
    it = iter(seconds)
    calls = []

    def scripted(drv, new_tokens, gen_tokens):
        real(drv, new_tokens, gen_tokens)  # the session really advances
        calls.append((drv.n, len(new_tokens)))
        t = next(it)
        return t, t

    monkeypatch.setattr(bench, "_frontier_times", scripted)
    out = tmp_path / "m.csv"
    argv = ["-m", "tiny", "--cpu", "-t", "1", "--ctx-start", "16", "--ctx-max", "28", "--step-incr", "12"]
    assert bench.main([*argv, "--gen-tokens", "3", "--repeats", str(repeats), "--csv", str(out)]) == 0
    assert calls == [(16, 16), (28, 12)] * repeats  # every pass starts from an empty session
    with open(out, newline="") as fh:
        return list(csv.DictReader(fh))


def test_sweep_rows_of_two_passes_are_the_warm_pass(tmp_path, monkeypatch):
    """--repeats 2: a cold first pass (5 s) and a warm one (1 s): the rows carry the warm speeds, not the
    mean of the two."""
    rows = _scripted_sweep(tmp_path, monkeypatch, [5.0, 5.0, 1.0, 1.0], repeats=2)
    assert [float(r["prefill_tps"]) for r in rows] == [16.0, 12.0]
    assert [float(r["gen_tps"]) for r in rows] == [3.0, 3.0]


def test_sweep_rows_are_medians_of_the_passes(tmp_path, monkeypatch):
    """--repeats 3: the passes' (prefill s, decode s) per frontier are scripted (a cold first pass, then a
    fast and a middle one); each row must carry the median speeds, i.e. the counts over 2 s."""
    rows = _scripted_sweep(tmp_path, monkeypatch, [5.0, 5.0, 1.0, 1.0, 2.0, 2.0], repeats=3)
    assert [(int(r["ctx_tokens"]), int(r["prefill_tokens"])) for r in rows] == [(16, 16), (28, 12)]
    assert [float(r["prefill_tps"]) for r in rows] == [8.0, 6.0]  # 16 / 2 s, 12 / 2 s
    assert [float(r["gen_tps"]) for r in rows] == [1.5, 1.5]  # 3 tokens / 2 s


def test_first_layers_cuts_flash_to_a_prefix():
    """The cut model plans the tensors of its layers only, with each kept layer's own ratio (an H100 times
    the first ~32 layers of the q2 model)."""
    from ds4.bench import first_layers
    from ds4.config import FLASH
    from ds4.tools.synthetic import plan

    assert first_layers(None) is FLASH
    cut = first_layers(5)
    assert cut.n_layer == 5 and cut.compress_ratios == FLASH.compress_ratios[:5]
    layers = {int(pt.name.split(".")[1]) for pt in plan(cut, "q2") if pt.name.startswith("blk.")}
    assert layers == set(range(5))
    full = {pt.name for pt in plan(FLASH, "q2")}
    assert {pt.name for pt in plan(cut, "q2")} <= full
