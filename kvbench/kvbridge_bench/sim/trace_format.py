"""The kvbridge JSONL trace format: reader, writer and validation.

Line 1 is the header; every other non-blank line is one request, in arrival
order (docs/trace-format.md)::

    {"format": "kvbridge-trace", "version": 1, "vocab_size": 128256, "name": "...", "meta": {}}
    {"request_id": "s0-t0", "session_id": "s0", "arrival_s": 0.0, "output_tokens": 120,
     "segments": [{"gen": [8121, 4096]}, {"tokens": [128000, 9906, 1917]}]}

Every defect raises :class:`TraceFormatError` naming the line; nothing is
returned from a bad file.
"""

from __future__ import annotations

import io
import json
import math
import os
from collections import Counter
from collections.abc import Iterable, Iterator
from typing import IO, Any, TypeGuard

from kvbridge.errors import InvalidArgument

from .trace import GenSegment, LiteralSegment, Segment, Trace, TraceRequest

__all__ = [
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "MAX_REQUEST_TOKENS",
    "TraceFormatError",
    "dump_jsonl",
    "load_jsonl",
    "parse_jsonl",
    "write_jsonl",
]

FORMAT_NAME = "kvbridge-trace"
FORMAT_VERSION = 1
MAX_REQUEST_TOKENS = 1 << 22  # 4M tokens per prompt
_HEADER_KEYS = {"format", "version", "vocab_size", "name", "meta"}
_REQUEST_KEYS = {"request_id", "session_id", "arrival_s", "output_tokens", "segments"}
_U64 = (1 << 64) - 1


class TraceFormatError(InvalidArgument):
    """A trace file breaks the format; ``line`` is 1-based (0: the whole file)."""

    def __init__(self, line: int, message: str) -> None:
        super().__init__(f"trace line {line}: {message}" if line else f"trace: {message}")
        self.line = line


# ---- writing ---------------------------------------------------------------------
def dump_jsonl(trace: Trace) -> str:
    """The trace as JSONL text."""
    out = io.StringIO()
    write_jsonl(trace, out)
    return out.getvalue()


def write_jsonl(trace: Trace, dest: str | os.PathLike[str] | IO[str]) -> None:
    """Write ``trace`` to a path or an open text stream."""
    if isinstance(dest, (str, os.PathLike)):
        with open(dest, "w", encoding="utf-8") as f:
            _write(trace, f)
    else:
        _write(trace, dest)


def _write(trace: Trace, f: IO[str]) -> None:
    header = {
        "format": FORMAT_NAME,
        "version": FORMAT_VERSION,
        "vocab_size": trace.vocab_size,
        "name": trace.name,
        "meta": trace.meta,
    }
    f.write(json.dumps(header, separators=(",", ":")) + "\n")
    for r in trace.requests:
        rec = {
            "request_id": r.request_id,
            "session_id": r.session_id,
            "arrival_s": r.arrival_s,
            "output_tokens": r.output_tokens,
            "segments": [_segment_json(s) for s in r.segments],
        }
        f.write(json.dumps(rec, separators=(",", ":")) + "\n")


def _segment_json(s: Segment) -> dict[str, Any]:
    if isinstance(s, GenSegment):
        return {"gen": [s.seed, s.length]}
    return {"tokens": list(s.tokens)}


# ---- reading ---------------------------------------------------------------------
def load_jsonl(
    src: str | os.PathLike[str] | IO[str] | IO[bytes],
    *,
    max_request_tokens: int = MAX_REQUEST_TOKENS,
) -> Trace:
    """Read and validate a trace from a path or an open (text or binary) stream."""
    if isinstance(src, (str, os.PathLike)):
        with open(src, "rb") as f:  # bytes: bad UTF-8 is reported at its line
            return parse_jsonl(f, max_request_tokens=max_request_tokens)
    return parse_jsonl(src, max_request_tokens=max_request_tokens)


class _Strict(ValueError):
    pass


def _no_constant(name: str) -> Any:
    raise _Strict(f"{name} is not JSON")


def _finite_float(text: str) -> float:
    v = float(text)
    if not math.isfinite(v):
        raise _Strict(f"{text} does not fit a double")
    return v


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        dup = sorted(k for k, n in Counter(k for k, _ in pairs).items() if n > 1)
        raise _Strict(f"duplicate keys {dup}")
    return out


def _loads(text: str) -> Any:
    """Strict JSON: no NaN or Infinity, no number beyond a double, no key twice."""
    return json.loads(
        text,
        parse_constant=_no_constant,
        parse_float=_finite_float,
        object_pairs_hook=_unique_keys,
    )


def parse_jsonl(
    lines: Iterable[str] | Iterable[bytes], *, max_request_tokens: int = MAX_REQUEST_TOKENS
) -> Trace:
    """Validate and build a trace from JSONL lines (str, or UTF-8 bytes)."""
    header: dict[str, Any] | None = None
    vocab = 0
    requests: list[TraceRequest] = []
    ids: set[str] = set()
    last_arrival = 0.0
    it: Iterator[str | bytes] = iter(lines)
    lineno = 0
    while True:
        lineno += 1
        try:
            item = next(it)
        except StopIteration:
            break
        except UnicodeDecodeError:  # a text stream that met bad bytes
            raise TraceFormatError(lineno, "not UTF-8") from None
        if isinstance(item, bytes):
            try:
                raw = item.decode("utf-8")
            except UnicodeDecodeError:
                raise TraceFormatError(lineno, "not UTF-8") from None
        else:
            raw = item
        if not raw.strip():
            continue
        try:
            obj = _loads(raw)
        except (json.JSONDecodeError, RecursionError, _Strict) as e:
            raise TraceFormatError(lineno, f"not JSON ({e})") from None
        if not isinstance(obj, dict):
            raise TraceFormatError(lineno, "a line must be a JSON object")
        if header is None:
            header = _check_header(lineno, obj)
            vocab = int(header["vocab_size"])
            continue
        req = _check_request(lineno, obj, vocab, max_request_tokens)
        if req.request_id in ids:
            raise TraceFormatError(lineno, f"duplicate request_id {req.request_id!r}")
        if req.arrival_s < last_arrival:
            raise TraceFormatError(lineno, "arrival_s goes backwards (sort by arrival)")
        ids.add(req.request_id)
        last_arrival = req.arrival_s
        requests.append(req)
    if header is None:
        raise TraceFormatError(0, "empty file: no header line")
    meta = header.get("meta", {})
    return Trace(requests, vocab, name=str(header.get("name", "")), meta=meta)


def _check_header(line: int, obj: dict[str, Any]) -> dict[str, Any]:
    if obj.get("format") != FORMAT_NAME:
        raise TraceFormatError(
            line, f'the first line must be the header {{"format": "{FORMAT_NAME}", ...}}'
        )
    if not _is_int(obj.get("version")) or obj["version"] != FORMAT_VERSION:
        raise TraceFormatError(
            line, f"trace version {obj.get('version')!r}; this reader reads {FORMAT_VERSION}"
        )
    extra = set(obj) - _HEADER_KEYS
    if extra:
        raise TraceFormatError(line, f"unknown header keys {sorted(extra)}")
    v = obj.get("vocab_size")
    if not _is_int(v) or not 2 <= v <= 1 << 31:
        raise TraceFormatError(line, f"vocab_size must be an int in [2, 2**31], got {v!r}")
    if not isinstance(obj.get("name", ""), str) or not isinstance(obj.get("meta", {}), dict):
        raise TraceFormatError(line, "name must be a string and meta an object")
    return obj


def _check_request(line: int, obj: dict[str, Any], vocab: int, max_tokens: int) -> TraceRequest:
    missing = _REQUEST_KEYS - set(obj)
    extra = set(obj) - _REQUEST_KEYS
    if missing or extra:
        raise TraceFormatError(
            line, f"request keys: missing {sorted(missing)}, unknown {sorted(extra)}"
        )
    rid, sid = obj["request_id"], obj["session_id"]
    if not isinstance(rid, str) or not rid or not isinstance(sid, str):
        raise TraceFormatError(line, "request_id must be a non-empty string, session_id a string")
    arr = obj["arrival_s"]
    try:  # an int may be beyond a double: OverflowError
        ok = not isinstance(arr, bool) and isinstance(arr, (int, float))
        ok = ok and math.isfinite(float(arr)) and arr >= 0
    except OverflowError:
        ok = False
    if not ok:
        raise TraceFormatError(line, f"arrival_s must be a finite number >= 0, got {arr!r}")
    out = obj["output_tokens"]
    if not _is_int(out) or not 0 <= out <= max_tokens:
        raise TraceFormatError(
            line, f"output_tokens must be an int in [0, {max_tokens}], got {out!r}"
        )
    segs_in = obj["segments"]
    if not isinstance(segs_in, list) or not segs_in:
        raise TraceFormatError(line, "segments must be a non-empty list")
    segs: list[Segment] = []
    total = 0
    for i, s in enumerate(segs_in):
        seg = _check_segment(line, i, s, vocab, max_tokens)
        total += seg.length
        if total > max_tokens:
            raise TraceFormatError(line, f"prompt longer than {max_tokens} tokens")
        segs.append(seg)
    return TraceRequest(rid, sid, float(arr), int(out), tuple(segs))


def _check_segment(line: int, i: int, s: object, vocab: int, max_tokens: int) -> Segment:
    if not isinstance(s, dict) or len(s) != 1:
        raise TraceFormatError(
            line, f'segment {i} must be {{"gen": [seed, length]}} or {{"tokens": [...]}}'
        )
    if "gen" in s:
        g = s["gen"]
        if not (isinstance(g, list) and len(g) == 2 and _is_int(g[0]) and _is_int(g[1])):
            raise TraceFormatError(line, f"segment {i}: gen must be [seed, length] (ints)")
        seed, length = g
        if not 0 <= seed <= _U64 or not 1 <= length <= max_tokens:
            raise TraceFormatError(
                line, f"segment {i}: seed in [0, 2**64), length in [1, {max_tokens}]"
            )
        return GenSegment(seed, length)
    if "tokens" in s:
        t = s["tokens"]
        if not isinstance(t, list) or not t or len(t) > max_tokens:
            raise TraceFormatError(line, f"segment {i}: tokens must be a non-empty list")
        if not all(_is_int(x) and 0 <= x < vocab for x in t):
            raise TraceFormatError(line, f"segment {i}: token ids must be ints in [0, {vocab})")
        return LiteralSegment(tuple(t))
    raise TraceFormatError(line, f"segment {i}: unknown kind {sorted(s)}")


def _is_int(v: object) -> TypeGuard[int]:
    return isinstance(v, int) and not isinstance(v, bool)
