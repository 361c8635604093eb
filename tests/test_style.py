"""The code base stays ruff clean (lint and format), checked with every test run."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("args", [["check", "."], ["format", "--check", "."]], ids=["lint", "format"])
def test_ruff(args: list[str]) -> None:
    if shutil.which("ruff") is None:
        cmd = [sys.executable, "-m", "ruff", *args]
    else:
        cmd = ["ruff", *args]
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
