"""Shared test fixtures: paths to ../shared, unpacked oracle GGUFs, the tiny synthetic model."""

from __future__ import annotations

import lzma
import os
import shutil
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("DS4_SHARED", REPO.parent / "shared"))
OFFICIAL_TINY = SHARED / "fixtures" / "official-tiny"
TEST_VECTORS = SHARED / "test-vectors"
BENCH_TEXT = SHARED / "bench-text" / "promessi_sposi.txt"

# Unpacked fixtures live outside the repo so that the working tree stays small (and travels to the GPU).
CACHE = Path(os.environ.get("DS4_TEST_CACHE", Path.home() / ".cache" / "ds4-test"))


def _unpack(name: str) -> Path:
    src = OFFICIAL_TINY / f"{name}.xz"
    if not src.exists():
        pytest.skip(f"oracle fixture missing: {src}")
    dst = CACHE / "official-tiny" / name
    if not dst.exists() or dst.stat().st_mtime < src.stat().st_mtime:
        dst.parent.mkdir(parents=True, exist_ok=True)
        tmp = dst.with_suffix(f".{os.getpid()}.tmp")  # per process: parallel runs must not race
        with lzma.open(src) as fin, open(tmp, "wb") as fout:
            shutil.copyfileobj(fin, fout, 1 << 20)
        tmp.replace(dst)
    return dst


@pytest.fixture(scope="session")
def official_gguf() -> Path:
    """The official-tiny oracle model (F32, F16 embeddings) as a GGUF path."""
    return _unpack("model.gguf")


@pytest.fixture(scope="session")
def official_q8_gguf() -> Path:
    """The official-tiny oracle model with Q8_0 matrices."""
    return _unpack("model-q8.gguf")


@pytest.fixture(scope="session")
def shared_dir() -> Path:
    if not SHARED.exists():
        pytest.skip(f"../shared not found at {SHARED}")
    return SHARED


def _one_torch_thread() -> None:
    try:
        import torch
    except ImportError:  # pragma: no cover - the text layer's tests need no torch
        return
    torch.set_num_threads(1)


@pytest.fixture(scope="session", autouse=True)
def _torch_one_thread_session():
    """One torch thread before any module-scoped fixture runs: those (a module's reference logits) are set
    up before the per-test fixture below, and a matmul at another thread count rounds differently."""
    _one_torch_thread()


@pytest.fixture(autouse=True)
def _torch_one_thread():
    """One torch thread: the test models are tiny, and on a shared 2-core machine extra threads only contend
    (decode ran 10x slower with two). Re-applied after each test: in-process CLI runs may change it (-t N)."""
    _one_torch_thread()
    yield
    _one_torch_thread()


def cuda_available() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:  # pragma: no cover - torch missing entirely
        return False


def _module_name(item) -> str:
    return getattr(getattr(item, "module", None), "__name__", "")


def pytest_collection_modifyitems(config, items):
    # the interpreter-run results last: the main process then runs the unstarted ones itself (_interp_runner)
    items.sort(key=lambda it: _module_name(it) == "test_kernels_interpreted")  # stable: the rest keep order
    if cuda_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA: GPU-only test, run on the device machine")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


def pytest_collection_finish(session):
    """Start the interpreter-mode kernel runs of the selected test_kernels_interpreted items in the
    background (tests/_interp_runner.py): they use the core the main process leaves idle."""
    if cuda_available():
        return
    mods = [it.callspec.params["module"] for it in session.items
            if it.module.__name__ == "test_kernels_interpreted" and hasattr(it, "callspec")]  # fmt: skip
    if mods and not session.config.option.collectonly:
        import _interp_runner

        _interp_runner.start(mods)


def pytest_sessionfinish(session, exitstatus):
    import sys

    runner = sys.modules.get("_interp_runner")
    if runner is not None:
        runner.stop()
