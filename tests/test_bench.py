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
