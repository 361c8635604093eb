"""Tokenizer encode speed: cold (first encode in a fresh process) and warm (piece cache filled).

    python tools/tok_speed.py [--runs 7] [--model GGUF] [--text FILE]

Each cold run is its own subprocess, so nothing cached in-process (our piece cache, the BPE model's own
cache, the compiled pre-tokenizer pattern, CPU caches warmed by an earlier encode) helps it. Tokenizer
construction is timed separately and is not part of the encode figure. MB/s are 10^6 bytes of UTF-8 text
per second, of CPU time (time.process_time: what this process burned, less sensitive to a shared machine)
and of wall time. The load average is printed because other work on the machine slows both.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("DS4_SHARED", REPO.parent / "shared"))
CACHE = Path(os.environ.get("DS4_TEST_CACHE", Path.home() / ".cache" / "ds4-test"))
DEFAULT_TEXT = SHARED / "bench-text" / "promessi_sposi.txt"
DEFAULT_MODEL = CACHE / "official-tiny" / "model.gguf"  # unpacked by the test suite (tests/conftest.py)
WARM_REPS = 3


def child(model: Path, text_path: Path) -> dict[str, float]:
    """One fresh process: build the tokenizer, time the first encode, then the warm ones."""
    w0, c0 = time.perf_counter(), time.process_time()
    from ds4.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf(model)
    text = text_path.read_text(encoding="utf-8")
    w1, c1 = time.perf_counter(), time.process_time()
    ids = tok.encode(text)
    w2, c2 = time.perf_counter(), time.process_time()
    warm_cpu, warm_wall = [], []
    for _ in range(WARM_REPS):
        w3, c3 = time.perf_counter(), time.process_time()
        again = tok.encode(text)
        warm_wall.append(time.perf_counter() - w3)
        warm_cpu.append(time.process_time() - c3)
        if again != ids:
            raise SystemExit("warm encode differs from the cold one")
    return {
        "bytes": len(text.encode("utf-8")),
        "ids": len(ids),
        "load_wall": w1 - w0,
        "load_cpu": c1 - c0,
        "cold_wall": w2 - w1,
        "cold_cpu": c2 - c1,
        "warm_wall": min(warm_wall),
        "warm_cpu": min(warm_cpu),
    }


def spread(label: str, mbps: list[float]) -> str:
    return f"{label} median {statistics.median(mbps):5.2f} MB/s  (min {min(mbps):5.2f}, max {max(mbps):5.2f})"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=7, help="fresh processes (cold encodes), default 7")
    ap.add_argument("--model", type=Path, default=DEFAULT_MODEL, help="GGUF with the vocabulary")
    ap.add_argument("--text", type=Path, default=DEFAULT_TEXT, help="UTF-8 text to encode")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    for what, path in (("model", args.model), ("text", args.text)):
        if not path.exists():
            hint = " (run tests/test_tokenizer.py once to unpack it)" if what == "model" else ""
            print(f"tok_speed: {what} file not found: {path}{hint}", file=sys.stderr)
            return 2
    if args.child:
        print(json.dumps(child(args.model, args.text)))
        return 0
    if args.runs < 1:
        print(f"tok_speed: --runs must be >= 1, got {args.runs}", file=sys.stderr)
        return 2

    load_before = os.getloadavg()
    cmd = [sys.executable, __file__, "--child", "--model", str(args.model), "--text", str(args.text)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    runs = []
    for _ in range(args.runs):
        out = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO)
        if out.returncode != 0:
            print(f"tok_speed: child failed ({out.returncode}):\n{out.stderr}", file=sys.stderr)
            return 1
        runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
    load_after = os.getloadavg()

    mb = runs[0]["bytes"] / 1e6
    print(f"text {args.text.name}: {mb:.2f} MB -> {runs[0]['ids']} ids; {args.runs} fresh processes")
    print(f"tokenizer construction: median {statistics.median(r['load_wall'] for r in runs):.2f} s wall")
    print(spread("cold cpu ", [mb / r["cold_cpu"] for r in runs]))
    print(spread("cold wall", [mb / r["cold_wall"] for r in runs]))
    print(spread("warm cpu ", [mb / r["warm_cpu"] for r in runs]))
    print(spread("warm wall", [mb / r["warm_wall"] for r in runs]))
    before, after = (" ".join(f"{x:.2f}" for x in load) for load in (load_before, load_after))
    print(f"load average before: {before}; after: {after} ({os.cpu_count()} cpus)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
