"""The ``--json`` contract of ``kvbridge-bench``: with ``--json``, stdout
carries the one JSON document and nothing else, so that ``kvbridge-bench
... --json | jq`` works; everything else (tables, progress bars, "missing:
mooncake" lines, warnings, the output of child processes and of C code) goes
to stderr.

:func:`json_stdout` points file descriptor 1 at stderr for the duration of a
command (so even what child processes and native code write lands there) and
keeps the real stdout for :func:`emit_json`.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
from collections.abc import Iterator
from typing import Any

# the real stdout while json_stdout() is active, else None
_json_fd: int | None = None


@contextlib.contextmanager
def json_stdout() -> Iterator[None]:
    """Within the block, fd 1 and ``sys.stdout`` are stderr; :func:`emit_json`
    writes to the stdout the process started with."""
    global _json_fd
    if _json_fd is not None:  # nested: already redirected
        yield
        return
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    _json_fd = saved
    try:
        # sys.stdout too, where it is not a plain file on fd 1 (an embedding)
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)
        _json_fd = None


def finite(obj: Any) -> Any:
    """``obj`` with every NaN or infinite float replaced by None: strict JSON
    has no such numbers (``jq`` rejects Python's ``NaN``)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [finite(v) for v in obj]
    return obj


def emit_json(obj: Any, *, indent: int | None = None) -> None:
    """Write ``obj`` as one strict JSON document (non-finite numbers as
    null) and a newline to stdout: the real one under :func:`json_stdout`."""
    text = json.dumps(finite(obj), indent=indent, allow_nan=False, default=str) + "\n"
    if _json_fd is None:
        sys.stdout.write(text)
        sys.stdout.flush()
        return
    data = text.encode()
    while data:
        n = os.write(_json_fd, data)
        data = data[n:]


def wants_json(args: Any) -> bool:
    """True when the command was asked for JSON on stdout: ``--json`` as a
    flag, or ``--json -`` where ``--json`` names a file."""
    value = getattr(args, "json", None)
    return value is True or value == "-"
