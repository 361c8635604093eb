"""Row 4: Server-Sent Events framing (pure text)."""

from __future__ import annotations

import json
from typing import Any

KEEPALIVE = ": keepalive\n\n"
DONE = "data: [DONE]\n\n"


def dumps(obj: Any) -> str:
    """Compact JSON with non-ASCII kept raw (the wire form of every body and chunk)."""
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


def data(obj: Any) -> str:
    """`data: <json>` (OpenAI chat/completions and Responses chunks)."""
    return f"data: {dumps(obj)}\n\n"


def event(name: str, obj: Any) -> str:
    """`event: <name>` + `data: <json>` (Anthropic)."""
    return f"event: {name}\ndata: {dumps(obj)}\n\n"
