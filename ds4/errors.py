"""Row 0: exception types shared by every layer (no imports from the rest of ds4).

Every error a user can cause (bad file, bad flag, bad request) is a `Ds4Error` whose message is
one line naming what was wrong, with the expected and the actual value. Front ends print it as
`ds4: <message>` and exit 2; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations


class Ds4Error(Exception):
    """Base class of user-facing ds4 errors (the message is shown as-is)."""


class ModelFileError(Ds4Error, ValueError):
    """The model file is unreadable, is not a ds4 GGUF, or does not match the layout it declares."""


class UsageError(Ds4Error):
    """Bad command-line usage (unknown mode combination, invalid flag value, missing model)."""
