"""The interpreter-mode kernel test runs (test_kernels_interpreted.py), started in the background.

Each module's run is a CPU-bound subprocess (10+ minutes in all on a 2-core machine) that shares nothing with
the main test process, which keeps torch to one thread (conftest._torch_one_thread): so the runs start when
collection ends (conftest.pytest_collection_finish), one at a time on the other core. The
test_kernels_under_interpreter items run last (conftest.pytest_collection_modifyitems), when the main process
has nothing else to do: each runs its module itself if the worker has not started it yet (both cores busy
to the end), else collects the worker's result. Whatever is still running when the session ends is killed.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent
TIMEOUT_S = 900  # one module's run

_pool: ThreadPoolExecutor | None = None
_futures: dict[str, Future] = {}
_running: set[subprocess.Popen] = set()
_lock = threading.Lock()
_stopped = False


def _run(module: str) -> tuple[int, str]:
    """(return code, output) of the module's tests in a fresh TRITON_INTERPRET=1 pytest."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(HERE / module)]
    with _lock:
        if _stopped:
            return -1, "session ended before this run started"
        out = {"stdout": subprocess.PIPE, "stderr": subprocess.STDOUT, "text": True}
        proc = subprocess.Popen(cmd, env=env, cwd=HERE.parent, **out)
        _running.add(proc)
    try:
        out, _ = proc.communicate(timeout=TIMEOUT_S)
        return proc.returncode, out
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        return -1, f"timed out after {TIMEOUT_S} s\n{out}"
    finally:
        with _lock:
            _running.discard(proc)


def start(modules: list[str]) -> None:
    """Queue the runs of `modules` (in this order) on one background worker; already queued ones stay."""
    global _pool
    with _lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="interp")
        for m in modules:
            if m not in _futures:
                _futures[m] = _pool.submit(_run, m)


def result(module: str) -> tuple[int, str]:
    """The module's (return code, output): run here if still waiting in the worker's queue, else the
    worker's."""
    start([module])
    fut = _futures[module]
    if fut.cancel():  # not started: the caller is idle, so it runs the module beside the worker
        done: Future = Future()
        done.set_result(_run(module))
        _futures[module] = fut = done
    return fut.result()


def stop() -> None:
    """Kill what runs, drop what waits (session end)."""
    global _stopped
    with _lock:
        _stopped = True
        for proc in list(_running):
            proc.kill()
    if _pool is not None:
        _pool.shutdown(wait=False, cancel_futures=True)
