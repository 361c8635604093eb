"""The first step of an entry point (`ds4`, `ds4-server`, `ds4-bench`) that may run as several processes.

Torch-free on purpose: a plain single-process run decides here without importing torch; only a torchrun
process (or `--gpus N`) loads ds4.dist.

    dist = launch.start(args.gpus, argv, "ds4.server.main", args.backend)   # None: one process
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from types import ModuleType


def launched() -> bool:
    """True when torchrun (or an equivalent launcher) started this process as one of several."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def current() -> ModuleType | None:
    """ds4.dist when this process is one of several, else None (nothing imported)."""
    if not launched():
        return None
    from ds4 import dist

    return dist


def start(
    gpus: int | None, argv: Sequence[str] | None, module: str, backend: str | None
) -> ModuleType | None:
    """--gpus N outside torchrun: re-exec `python -m module argv` under torch.distributed.run with N
    processes (does not return). Inside torchrun: join the process group (gloo for the cpu backend).
    Returns current()."""
    if not launched() and not (gpus and gpus > 1):
        return None  # the common case: no torch import
    from ds4 import dist

    dist.start(gpus, list(sys.argv[1:] if argv is None else argv), module, backend)
    return current()
