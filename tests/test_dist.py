"""Expert parallelism over torch.distributed on the CPU (gloo, 2 processes) against the single process.

The 2-process runs go through torchrun, like a user's launch: this file is also the worker script (`python
-m torch.distributed.run ... tests/test_dist.py MODEL OUT`), whose rank 0 saves the logits of a fixed
scenario. The oracle is the same scenario run in this (single) process: equal logits within 1e-5 relative
mean the shards + all_reduce reproduce the full expert sum; the device model's must be identical bit for bit
(it all_reduces per-slot outputs and sums the slots afterwards in a fixed order). Both the CPU reference
(DS4Model, via Engine / Session: prefill, decodes, checkpoint rewind, snapshot restore, reset, decode_batch)
and the device model's code on the CPU (CudaModel(device="cpu"): sharded weight store, routed_prefill /
routed_decode masks) are covered, the latter twice: Packed stacks (F32 model) and the ds4.kernels
PackedWeight stacks (Q8_0 model, kernels=True: the fused-kernel decode and the grouped prefill, whose CPU
fallbacks run the same masking and all_reduce code as on the GPU; DS4_GROUPED_F32=1 selects the grouped
prefill for float32).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
PROMPT = [5, 900, 17, 4242, 77, 31000, 12, 8, 64000, 3, 19, 250]
CTX = 64
REL_TOL = 1e-5


# ---------------------------------------------------------------------------------------------
# The scenario (run identically by the single process and by rank 0 of the group)
# ---------------------------------------------------------------------------------------------


def engine_scenario(engine) -> dict[str, torch.Tensor]:
    out = {}
    a = engine.session(CTX)
    a.sync(PROMPT)
    out["prefill"] = a.logits.clone()
    for i in range(3):
        out[f"decode{i}"] = a.eval(int(a.logits.argmax())).clone()
    b = engine.session(CTX)
    b.sync(PROMPT[:6])
    out["batch"] = engine.model.decode_batch([a.state, b.state], [101, 202]).clone()
    a.sync([*PROMPT, 303])  # not an extension of what `a` holds: rewinds to its prompt checkpoint
    out["rewind"] = a.logits.clone()
    c = engine.session(CTX)
    c.restore(a.snapshot())
    out["restored"] = c.eval(404).clone()
    b.sync([7, 7, 7])  # unrelated prompt: reset, then prefill
    out["reset"] = b.logits.clone()
    return out


def device_scenario(model, tag: str) -> dict[str, torch.Tensor]:
    out = {}
    s = model.new_state(CTX)
    out[f"{tag}_prefill"] = first = model.forward(s, PROMPT).clone()
    for i in range(2):
        out[f"{tag}_decode{i}"] = model.forward(s, [int(first.argmax()) + i]).clone()
    pool = model.new_states(2, CTX)
    model.forward(pool[0], PROMPT[:5])
    model.forward(pool[1], PROMPT[:3])
    out[f"{tag}_batch"] = model.decode_batch(pool, [11, 22]).clone()
    return out


def load_device_model(path: str, kernels: bool):
    from ds4.gguf import open_model
    from ds4.model.cuda import CudaModel, gguf_source

    mf = open_model(Path(path))
    return CudaModel(mf.config, gguf_source(mf), has=mf.has, device="cpu", kernels=kernels)


def worker(model_path: str, q8_path: str, out_path: str) -> None:
    """torchrun entry: every rank loads the three models; rank 0 drives the scenarios through Leaders."""
    from ds4 import dist
    from ds4.engine import Engine

    dist.init("gloo")
    engine = Engine.open(model_path, backend="cpu", threads=1)
    dev = load_device_model(model_path, kernels=False)
    kdev = load_device_model(q8_path, kernels=True)
    n_local = dev.layers[0].w.moe.gate_exps.data.shape[0]
    experts = dist.expert_range(engine.config.n_expert)
    if dist.rank() > 0:
        for model in (engine.model, dev, kdev):  # each until rank 0's Leader ends it
            dist.follow(model)
        dist.shutdown()
        return
    engine.model = dist.Leader(engine.model)
    result = engine_scenario(engine)
    engine.model.end()
    for model, tag in ((dev, "dev"), (kdev, "kq8")):
        leader = dist.Leader(model)
        result.update(device_scenario(leader, tag))
        leader.end()
    result["n_local"] = torch.tensor(n_local)
    result["experts"] = torch.tensor(experts)
    torch.save(result, out_path)
    dist.shutdown()


# ---------------------------------------------------------------------------------------------
# Tests
# ---------------------------------------------------------------------------------------------


def _env() -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env["DS4_GROUPED_F32"] = "1"
    env["DS4_LOCK_FILE"] = str(Path(env.get("TMPDIR", "/tmp")) / f"ds4-test-dist-{os.getpid()}.lock")
    return env


def _torchrun(args: list[str], timeout: float = 240) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", *args]
    return subprocess.run(cmd, capture_output=True, env=_env(), timeout=timeout, cwd=ROOT)


def rel_diff(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).abs().max() / want.float().abs().max())


def test_two_processes_equal_single_process_logits(official_gguf, official_q8_gguf, tmp_path, monkeypatch):
    from ds4.engine import Engine

    out = tmp_path / "dist.pt"
    proc = _torchrun([str(Path(__file__)), str(official_gguf), str(official_q8_gguf), str(out)])
    assert proc.returncode == 0, proc.stderr.decode()[-3000:]
    got = torch.load(out)
    assert got["experts"].tolist() == [0, 8] and int(got["n_local"]) == 8  # 16 experts: half on rank 0

    with Engine.open(official_gguf, backend="cpu", threads=1) as engine:
        want = engine_scenario(engine)
    monkeypatch.setenv("DS4_GROUPED_F32", "1")
    want.update(device_scenario(load_device_model(str(official_gguf), kernels=False), "dev"))
    kdev = load_device_model(str(official_q8_gguf), kernels=True)
    assert type(kdev.layers[0].w.moe.gate_exps).__name__ == "PackedWeight"  # the kernels' stacks
    want.update(device_scenario(kdev, "kq8"))
    diffs = {k: rel_diff(got[k], w) for k, w in want.items()}
    print("max relative logit diff, 2 processes vs 1:", {k: f"{d:.2e}" for k, d in diffs.items()})
    bad = {k: d for k, d in diffs.items() if not d <= REL_TOL}
    assert not bad, f"logits differ beyond {REL_TOL}: {bad}"
    # the device model sums expert outputs per slot across ranks (experts.combine_slots): bit for bit
    inexact = {k: d for k, d in diffs.items() if k.startswith(("dev_", "kq8_")) and d != 0.0}
    assert not inexact, f"device-model logits not bit-identical across 1 / 2 processes: {inexact}"


def test_torchrun_cli_prints_what_the_single_process_prints(official_gguf, capsys, monkeypatch):
    from ds4 import cli

    args = ["-m", str(official_gguf), "--backend", "cpu", "--nothink", "--temp", "0", "-n", "16", "-p",
            "Hello world"]  # fmt: skip
    monkeypatch.setenv("DS4_LOCK_FILE", _env()["DS4_LOCK_FILE"])
    assert cli.main(args) == 0
    single = capsys.readouterr().out.encode()
    exe = shutil.which("ds4")
    launch = ["--no-python", exe] if exe else ["-m", "ds4"]
    proc = _torchrun([*launch, *args])
    assert proc.returncode == 0, proc.stderr.decode()[-3000:]
    assert proc.stdout == single
    assert len(single) > 0


def test_expert_range_splits_evenly():
    from ds4 import dist

    assert [dist.expert_range(256, r, 2) for r in range(2)] == [(0, 128), (128, 256)]
    assert dist.expert_range(256, 3, 8) == (96, 128)
    assert dist.expert_range(16) == (0, 16)  # no process group: everything
    assert dist.on_leader(lambda: "path") == "path" and dist.gather_objects(3) == [3]
    with pytest.raises(dist.DistError, match="256 routed experts do not split evenly over 3"):
        dist.expert_range(256, 0, 3)


def test_gpus_flag_relaunch_command():
    from ds4 import dist

    argv = dist.without_flag(["-m", "x.gguf", "--gpus", "2", "-p", "hi", "--gpus=4"])
    assert argv == ["-m", "x.gguf", "-p", "hi"]
    cmd = dist.torchrun_command(2, argv)
    assert cmd[1:] == [
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
        "-m",
        "ds4",
        *argv,
    ]
    assert dist.torchrun_command(4, [], "ds4.server.main")[-2:] == ["-m", "ds4.server.main"]
    assert dist.NVLS_OFF["NCCL_NVLS_ENABLE"] == "0"


@pytest.mark.parametrize("rows", [(0, 3), (2, 7), (5, 16), (8, 16)])
def test_synthetic_expert_slice_equals_slice_of_whole_stack(monkeypatch, rows):
    from ds4.config import TINY
    from ds4.tools import synthetic

    monkeypatch.setattr(synthetic, "CHUNK_ELEMS", 3 * 2048)  # a few experts per chunk: slices cross chunks
    pt = next(p for p in synthetic.plan(TINY, "q2") if p.name == "blk.1.ffn_down_exps.weight")
    assert synthetic.n_chunks(pt.spec.shape) > 2
    whole = synthetic.tensor_bytes(pt, TINY, seed=3)
    part = synthetic.tensor_bytes(pt, TINY, seed=3, rows=rows)
    assert torch.equal(part, whole[rows[0] : rows[1]])
    built = synthetic.build_weights(
        TINY, "q2", seed=3, names=[pt.name, "output_norm.weight"], expert_rows=rows
    )
    assert torch.equal(built[pt.name][1], part)
    whole_norm = synthetic.build_weights(TINY, "q2", seed=3, names=["output_norm.weight"])
    assert torch.equal(built["output_norm.weight"][1], whole_norm["output_norm.weight"][1])  # not sliced


def test_weight_store_cuts_this_ranks_experts(monkeypatch):
    from ds4 import dist
    from ds4.model.cuda import weights

    raw = torch.arange(8 * 6, dtype=torch.uint8)  # 8 experts x 6 bytes
    monkeypatch.setattr(dist, "expert_range", lambda n: (4, 8))
    flat, n = weights.expert_rows("x", raw, 8, 6)
    assert n == 4 and torch.equal(flat, raw[24:])
    flat, n = weights.expert_rows("x", raw[24:], 8, 6)  # the source already gave this rank's rows
    assert n == 4 and torch.equal(flat, raw[24:])
    with pytest.raises(ValueError, match="expected 8 experts x 6 bytes"):
        weights.expert_rows("x", raw[:10], 8, 6)


if __name__ == "__main__":
    worker(sys.argv[1], sys.argv[2], sys.argv[3])
