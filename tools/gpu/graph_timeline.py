"""Where a replayed decode graph's time goes (issues 5 and 8): the kernels of the captured B = 1 step (or,
with --batch, the batched step of B sessions) as the GPU ran them, what each one's end added to the step,
and the gaps where nothing ran.

On the H200:  PYTHONPATH=. python3 tools/gpu/graph_timeline.py [--ctx 4096] [--steps 8] [--top 30] [--batch B]

profile_regions.py runs the step eagerly (every kernel seen, but not the graph's overlap, PDL and side
lanes); this one replays the graph the engine decodes with, under torch.profiler, and reads the kernel
records of each cudaGraphLaunch (their correlation id) from the Chrome trace. Per step (median over
--steps replays):
  * span: first kernel start to last kernel end; busy: the union of all kernels' intervals (any stream);
    idle: span - busy (no kernel resident anywhere: launch latency the graph did not hide);
  * the kernels in the order they end as one chain: each is charged excl = end_i - max(start_i, end_{i-1})
    (what finishing it added to the step) and gap = max(0, start_i - end_{i-1}) (nothing ran before it
    started); excl + gap over the kernels sum to the span. A replayed graph's kernels carry the graph's own
    stream ids, not the capture's lanes, so no stream is singled out;
  * by kernel name: calls, summed duration, excl, gaps, excl as a share of the span.
With PDL a dependent kernel starts early and waits in griddepcontrol.wait, so its duration includes that
wait (duration - excl: the time it overlapped others); the chain does not double count it.

Legend: us microseconds; excl the time a kernel's end added to the step; gap idle time before a kernel.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


@dataclass(frozen=True)
class Kernel:
    """One kernel record: name, stream, start and end (us), the correlation id of its launch."""

    name: str
    stream: int
    start: float
    end: float
    corr: int


def graph_kernels(trace: dict) -> list[list[Kernel]]:
    """The kernel records of each cudaGraphLaunch in a Chrome trace (torch.profiler's export), one list per
    launch in launch order, each sorted by start."""
    launches = {}
    for ev in trace.get("traceEvents", []):
        if ev.get("cat") == "cuda_runtime" and "GraphLaunch" in ev.get("name", ""):
            launches[ev["args"]["correlation"]] = float(ev["ts"])
    steps: dict[int, list[Kernel]] = defaultdict(list)
    for ev in trace.get("traceEvents", []):
        if ev.get("cat") != "kernel":
            continue
        corr = ev.get("args", {}).get("correlation")
        if corr in launches:
            t0 = float(ev["ts"])
            k = Kernel(ev["name"], int(ev["args"].get("stream", -1)), t0, t0 + float(ev["dur"]), corr)
            steps[corr].append(k)
    return [sorted(steps[c], key=lambda k: k.start) for c in sorted(steps, key=launches.get)]


def union_length(spans: list[tuple[float, float]]) -> float:
    """Total length covered by the intervals (start, end)."""
    total, cur_s, cur_e = 0.0, None, None
    for s, e in sorted(spans):
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    return total + (cur_e - cur_s if cur_e is not None else 0.0)


@dataclass
class StepStats:
    """One step's figures (us): span, busy, streams seen, and per kernel name [calls, dur, excl, gap]."""

    span: float
    busy: float
    n_kernels: int
    n_streams: int
    names: dict[str, list[float]]

    @property
    def idle(self) -> float:
        return self.span - self.busy


def analyze(kernels: list[Kernel]) -> StepStats:
    """The figures of one step's kernels (see the module docstring): the kernels taken in the order they
    end, each charged the time from the previous end to its own (excl: from its start if later; the time
    before that start, when nothing ran, its gap)."""
    if not kernels:
        raise ValueError("no kernels in the step")
    names: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0.0, 0.0])
    prev_end = min(k.start for k in kernels)
    for k in sorted(kernels, key=lambda k: k.end):
        row = names[k.name]
        row[0] += 1
        row[1] += k.end - k.start
        row[2] += k.end - max(k.start, prev_end)
        row[3] += max(0.0, k.start - prev_end)
        prev_end = k.end
    return StepStats(
        span=max(k.end for k in kernels) - min(k.start for k in kernels),
        busy=union_length([(k.start, k.end) for k in kernels]),
        n_kernels=len(kernels),
        n_streams=len({k.stream for k in kernels}),
        names=dict(names),
    )


def short(name: str, width: int = 70) -> str:
    return name if len(name) <= width else name[: width - 3] + "..."


def report(stats: list[StepStats], top: int) -> None:
    """Print the medians over the steps and the top names by exclusive time."""
    med = statistics.median
    span, busy = med(s.span for s in stats), med(s.busy for s in stats)
    print(f"{len(stats)} replayed steps, median: span {span:.1f} us, busy (any stream) {busy:.1f} us, idle "
          f"{span - busy:.1f} us ({100 * (span - busy) / span:.1f} %); {med(s.n_kernels for s in stats):.0f} "
          f"kernels on {med(s.n_streams for s in stats):.0f} streams")  # fmt: skip
    keys = {n for s in stats for n in s.names}
    rows = []
    for n in keys:
        vals = [s.names.get(n, [0, 0.0, 0.0, 0.0]) for s in stats]
        rows.append((n, *(med(v[i] for v in vals) for i in range(4))))
    rows.sort(key=lambda r: -(r[3] + r[4]))
    print(f"{'calls':>6} {'dur us':>9} {'excl us':>9} {'gap us':>8} {'excl %':>7}  kernel (by excl + gap)")
    for n, calls, dur, excl, gap in rows[:top]:
        print(f"{calls:>6.0f} {dur:>9.1f} {excl:>9.1f} {gap:>8.1f} {100 * excl / span:>6.1f}%  {short(n)}")
    rest = rows[top:]
    if rest:
        calls, dur, excl, gap = (sum(r[i] for r in rest) for i in range(1, 5))
        print(f"{calls:>6.0f} {dur:>9.1f} {excl:>9.1f} {gap:>8.1f}          ({len(rest)} other names)")


def _single_steps(model, steps: int, first: int, state) -> Callable[[], None]:
    """A step of the single-session decode graph (B = 1) at state's next position."""
    from ds4.model.cuda.model import ctx_bound

    runner = model.runner(state)
    runner.token.fill_(first)
    runner.pos.fill_(state.n_tokens)
    bound = ctx_bound(state.n_tokens + steps + 1, state.ctx)
    # the same position each time: a decode step's work (the state's values drift, its sizes do not)
    return lambda: runner.step(bound)


def _batch_steps(model, pool: list, first: int) -> Callable[[], None]:
    """A step of the batched decode graph over the pool's sessions (distinct tokens: distinct experts)."""
    from ds4.model.cuda.model import BatchRunner

    kv = pool[0].pool
    runner = kv.runner = kv.runner or BatchRunner(model, kv)
    V = model.cfg.n_vocab
    slots = [s.slot for s in pool]
    toks = [(first + 7919 * i) % V for i in range(len(pool))]
    pos = [s.n_tokens for s in pool]
    return lambda: runner.step(slots, toks, pos)


def main() -> int:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from ds4.bench import first_layers, synthetic_model

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ctx", type=int, default=4096)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--top", type=int, default=30)
    p.add_argument("--batch", type=int, default=1, help="> 1: the batched step of that many sessions")
    p.add_argument("--layers", type=int, default=None, help="the first N layers of Flash (H100: ~32)")
    a = p.parse_args()
    if not torch.cuda.is_available():
        print("graph_timeline: needs a CUDA GPU", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    model = synthetic_model("q2", cfg=first_layers(a.layers))
    alloc = a.ctx + a.steps + 16
    pool = model.new_states(a.batch, alloc) if a.batch > 1 else [model.new_state(alloc)]
    V = model.cfg.n_vocab
    with torch.inference_mode():
        first = int(model.forward(pool[0], [(i * 7919 + 13) % V for i in range(a.ctx)]).argmax())
        for st in pool[1:]:
            st.copy_from(pool[0])
        print(f"built and prefilled {a.ctx} tokens (B = {a.batch}) in {time.perf_counter() - t0:.1f} s")
        step = (
            _batch_steps(model, pool, first) if a.batch > 1 else _single_steps(model, a.steps, first, pool[0])
        )
        # captured inside the profile too: kernels of a graph instantiated before tracing began may go
        # unrecorded; only the replays' launches are read
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(a.steps + 1):  # the first: capture (and its eager warm-up)
                step()
            torch.cuda.synchronize()
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        trace = json.loads(Path(f.name).read_text())
    steps = graph_kernels(trace)
    if not steps:
        print("graph_timeline: no kernel records of a graph launch in the trace", file=sys.stderr)
        return 1
    counts = [len(s) for s in steps]
    print(f"{len(steps)} graph launches traced, kernels per launch {min(counts)}-{max(counts)}")
    report([analyze(s) for s in steps[-a.steps :]], a.top)
    return 0


if __name__ == "__main__":
    sys.exit(main())
