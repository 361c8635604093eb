"""The CPU forward pass against the official DeepSeek V4 code (official-tiny fixture, F32 and Q8_0 GGUFs).

Each case: prefill chunks[0] tokens at position 0, resume with later chunks, then decode steps feeding the
recorded argmax tokens; every step's logits are compared with the official float32 logits.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from _gguf_model import load_model
from conftest import OFFICIAL_TINY

MAX_TOL = 5e-3  # float32 rounding noise can flip one FP8/FP4 step (README "Tolerances")
MEAN_TOL = 1e-3


def _cases(kind: str) -> list[dict]:
    path = OFFICIAL_TINY / "cases.json"
    if not path.exists():
        return []
    return json.loads(path.read_text())[kind]


@pytest.fixture(scope="module")
def expected_logits() -> dict[str, np.ndarray]:
    with np.load(OFFICIAL_TINY / "logits.npz") as z:
        return {k: z[k] for k in z.files}


def run_case(model, case: dict) -> np.ndarray:
    """Logits [n_steps, V] for the case's recorded steps (see the fixture README)."""
    tokens, chunks = case["tokens"], case["chunks"]
    state = model.new_state(len(tokens) + 8)
    out, start = [], 0
    for end in chunks:
        out.append(model.forward(state, tokens[start:end]))
        start = end
    for tok in tokens[start : start + case["decode_steps"]]:
        out.append(model.forward(state, [tok]))
    assert state.n_tokens == chunks[-1] + case["decode_steps"]
    return torch.stack(out).numpy()


def check_case(model, case: dict, expected: np.ndarray) -> None:
    got = run_case(model, case)
    assert got.shape == expected.shape
    want_argmax = [s["argmax"] for s in case["steps"]]
    assert got.argmax(1).tolist() == want_argmax == expected.argmax(1).tolist()
    diff = np.abs(got.astype(np.float64) - expected)
    print(f"{case['logits_key']}: max {diff.max():.2e} mean {diff.mean():.2e}")
    assert diff.mean() <= MEAN_TOL, f"mean |dlogit| {diff.mean():.3e}"
    assert diff.max() <= MAX_TOL, f"max |dlogit| {diff.max():.3e} (per step {diff.max(1)})"


@pytest.mark.parametrize("case", _cases("cases"), ids=lambda c: c["logits_key"])
def test_official_f32(official_gguf, expected_logits, case):
    assert case["weights"] == "model.gguf"
    check_case(load_model(official_gguf), case, expected_logits[case["logits_key"]])


@pytest.mark.parametrize("case", _cases("q8_cases"), ids=lambda c: c["logits_key"])
def test_official_q8(official_q8_gguf, expected_logits, case):
    assert case["weights"] == "model-q8.gguf" and case["logits_key"].startswith("q8__")
    check_case(load_model(official_q8_gguf), case, expected_logits[case["logits_key"]])


def test_fixture_has_cases():
    """Guard against silently testing nothing when the fixture moved."""
    assert len(_cases("cases")) >= 6 and len(_cases("q8_cases")) >= 2
