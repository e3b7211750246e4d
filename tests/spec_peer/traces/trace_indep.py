"""Independent reader/writer for the JSONL "kvbridge-trace" format (version 1).

Written from /tmp/indepT/trace-format.md ONLY, standard library only.
Assumptions where the spec is silent are marked "ASSUME" (see REPORT.md).
"""
import hashlib
import json
import math
import struct
import sys

FORMAT = "kvbridge-trace"
VERSION = 1
VOCAB_MIN = 2            # spec line 21: "2 .. 2^31"   (ASSUME inclusive)
VOCAB_MAX = 2 ** 31
SEED_LIMIT = 2 ** 64     # spec line 44-45: seed in [0, 2^64)
DEFAULT_MAX_REQUEST_TOKENS = 2 ** 22   # spec line 56 (ASSUME "at most" = inclusive)
M64 = (1 << 64) - 1

HEADER_REQUIRED = ("format", "version", "vocab_size")
HEADER_OPTIONAL = ("name", "meta")
REQUEST_KEYS = ("request_id", "session_id", "arrival_s", "output_tokens", "segments")


class TraceFormatError(ValueError):
    def __init__(self, line, msg):
        super().__init__(f"line {line}: {msg}")
        self.line = line
        self.msg = msg


class GenSegment:
    __slots__ = ("seed", "length")

    def __init__(self, seed, length):
        self.seed, self.length = seed, length

    def __len__(self):
        return self.length

    def to_json(self):
        return {"gen": [self.seed, self.length]}


class LiteralSegment:
    __slots__ = ("tokens",)

    def __init__(self, tokens):
        self.tokens = list(tokens)

    def __len__(self):
        return len(self.tokens)

    def to_json(self):
        return {"tokens": list(self.tokens)}


class TraceRequest:
    __slots__ = ("request_id", "session_id", "arrival_s", "output_tokens", "segments")

    def __init__(self, request_id, session_id, arrival_s, output_tokens, segments):
        self.request_id = request_id
        self.session_id = session_id
        self.arrival_s = arrival_s
        self.output_tokens = output_tokens
        self.segments = list(segments)

    def prompt_len(self):
        return sum(s.length if isinstance(s, GenSegment) else len(s.tokens) for s in self.segments)


class Trace:
    def __init__(self, requests, vocab_size, name=None, meta=None):
        self.requests = list(requests)
        self.vocab_size = vocab_size
        self.name = name
        self.meta = meta

    def tokens(self, request):
        return expand(request.segments, self.vocab_size)


# ----------------------------------------------------------------- gen

def gen_tokens(seed, length, vocab_size):
    """Spec lines 45-50, verbatim."""
    out = []
    z0 = seed
    for i in range(length):
        z = (z0 + (i + 1) * 0x9E3779B97F4A7C15) & M64
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
        out.append((z ^ (z >> 31)) % vocab_size)
    return out


def expand(segments, vocab_size):
    out = []
    for s in segments:
        if isinstance(s, GenSegment):
            out.extend(gen_tokens(s.seed, s.length, vocab_size))
        else:
            out.extend(s.tokens)
    return out


def prompt_bytes(tokens):
    """little-endian int32 (vocab_size <= 2^31, so every id fits)."""
    return struct.pack("<%di" % len(tokens), *tokens)


def prompt_sha256(tokens):
    return hashlib.sha256(prompt_bytes(tokens)).hexdigest()


# ----------------------------------------------------------------- reader

def _is_int(x):
    # ASSUME: JSON true/false are not ints; 1.0 / 1e3 are not ints
    # (only integer literals without fraction/exponent count).
    return type(x) is int


def _is_number(x):
    # ASSUME: "number" = JSON int or float literal, not true/false.
    return type(x) in (int, float)


class _DupKey(Exception):
    pass


def _pairs_hook(pairs):
    d = {}
    for k, v in pairs:
        if k in d:           # ASSUME: duplicate keys are an error
            raise _DupKey(k)
        d[k] = v
    return d


def _reject_constant(name):  # ASSUME: NaN / Infinity / -Infinity are not JSON
    raise ValueError("non-standard JSON constant " + name)


def _loads(text, lineno):
    try:
        return json.loads(text, object_pairs_hook=_pairs_hook,
                          parse_constant=_reject_constant)
    except _DupKey as e:
        raise TraceFormatError(lineno, f"duplicate key {e.args[0]!r}")
    except (ValueError, RecursionError) as e:
        raise TraceFormatError(lineno, f"not JSON: {e}")


_JSON_WS = " \t\r"


def _split_lines(data):
    """bytes -> [(lineno, str)].  Lines end at b'\\n' only (ASSUME; U+2028,
    U+0085, lone CR are not line ends).  A final newline is optional."""
    pieces = data.split(b"\n")
    if pieces and pieces[-1] == b"":
        pieces.pop()
    out = []
    for i, raw in enumerate(pieces, 1):
        try:
            text = raw.decode("utf-8", errors="strict")
        except UnicodeDecodeError as e:
            raise TraceFormatError(i, f"not UTF-8: {e}")   # ASSUME: report that line
        if i == 1 and text.startswith("\ufeff"):
            # ASSUME: a BOM is not allowed (json.loads rejects it: "not JSON")
            pass
        out.append((i, text))
    return out


def _check_header(obj, lineno):
    if not isinstance(obj, dict):
        raise TraceFormatError(lineno, "header is not an object")
    for k in obj:
        if k not in HEADER_REQUIRED and k not in HEADER_OPTIONAL:
            raise TraceFormatError(lineno, f"unknown header key {k!r}")  # ASSUME applies to header
    for k in HEADER_REQUIRED:
        if k not in obj:
            raise TraceFormatError(lineno, f"missing header key {k!r}")
    if type(obj["format"]) is not str or obj["format"] != FORMAT:
        raise TraceFormatError(lineno, "wrong format")
    if not _is_int(obj["version"]) or obj["version"] != VERSION:
        raise TraceFormatError(lineno, "wrong version")
    v = obj["vocab_size"]
    if not _is_int(v) or not (VOCAB_MIN <= v <= VOCAB_MAX):
        raise TraceFormatError(lineno, "vocab_size not an int in 2 .. 2^31")
    if "name" in obj and type(obj["name"]) is not str:   # ASSUME null not allowed
        raise TraceFormatError(lineno, "name is not a string")
    if "meta" in obj and not isinstance(obj["meta"], dict):
        raise TraceFormatError(lineno, "meta is not an object")
    return v


def _check_segment(seg, lineno, vocab_size):
    if not isinstance(seg, dict):
        raise TraceFormatError(lineno, "segment is not an object")
    keys = set(seg)
    if keys == {"tokens"}:
        toks = seg["tokens"]
        if not isinstance(toks, list) or not toks:
            raise TraceFormatError(lineno, "tokens must be a non-empty list")
        for t in toks:
            if not _is_int(t):
                raise TraceFormatError(lineno, "token id is not an int")
            if not (0 <= t < vocab_size):
                raise TraceFormatError(lineno, "token id out of [0, vocab_size)")
        return LiteralSegment(toks)
    if keys == {"gen"}:
        g = seg["gen"]
        if not isinstance(g, list) or len(g) != 2:
            raise TraceFormatError(lineno, "gen must be [seed, length]")
        seed, length = g
        if not _is_int(seed) or not (0 <= seed < SEED_LIMIT):
            raise TraceFormatError(lineno, "gen seed not an int in [0, 2^64)")
        if not _is_int(length) or length < 1:
            raise TraceFormatError(lineno, "gen length not an int >= 1")
        return GenSegment(seed, length)
    raise TraceFormatError(lineno, f"segment must have exactly one of tokens/gen, got {sorted(keys)}")


def _check_request(obj, lineno, vocab_size, max_request_tokens, max_output_tokens):
    if not isinstance(obj, dict):
        raise TraceFormatError(lineno, "request is not an object")
    for k in obj:
        if k not in REQUEST_KEYS:
            raise TraceFormatError(lineno, f"unknown request key {k!r}")
    for k in REQUEST_KEYS:
        if k not in obj:
            raise TraceFormatError(lineno, f"missing request key {k!r}")
    rid = obj["request_id"]
    if type(rid) is not str or rid == "":
        raise TraceFormatError(lineno, "request_id must be a non-empty string")
    if type(obj["session_id"]) is not str:   # ASSUME empty session_id allowed
        raise TraceFormatError(lineno, "session_id must be a string")
    a = obj["arrival_s"]
    if _is_number(a):
        # ASSUME: arrival_s is an IEEE double; an integer literal is converted
        # (one too large for a double counts as non-finite); comparisons with
        # the previous line are done on the doubles.
        try:
            a = float(a)
        except OverflowError:
            a = math.inf
    if not _is_number(a) or not math.isfinite(a) or a < 0:
        raise TraceFormatError(lineno, "arrival_s must be a finite number >= 0")
    ot = obj["output_tokens"]
    if not _is_int(ot) or ot < 0 or (max_output_tokens is not None and ot > max_output_tokens):
        raise TraceFormatError(lineno, "output_tokens out of 0 .. max")
    segs = obj["segments"]
    if not isinstance(segs, list) or not segs:
        raise TraceFormatError(lineno, "segments must be a non-empty list")
    out = [_check_segment(s, lineno, vocab_size) for s in segs]
    if sum(s.length if isinstance(s, GenSegment) else len(s.tokens) for s in out) > max_request_tokens:
        raise TraceFormatError(lineno, "prompt longer than max_request_tokens")
    return TraceRequest(rid, obj["session_id"], a, ot, out)


def parse_bytes(data, max_request_tokens=DEFAULT_MAX_REQUEST_TOKENS, max_output_tokens="same"):
    """ASSUME: the "max" of output_tokens (spec line 37) is max_request_tokens."""
    if max_output_tokens == "same":
        max_output_tokens = max_request_tokens
    lines = _split_lines(data)
    header = None
    vocab = None
    requests = []
    seen = set()
    prev_arrival = None
    for lineno, text in lines:
        if text.strip(_JSON_WS) == "":     # ASSUME blank = only space/tab/CR
            continue
        obj = _loads(text, lineno)
        if header is None:
            # ASSUME: header is the first non-blank line
            vocab = _check_header(obj, lineno)
            header = obj
            continue
        req = _check_request(obj, lineno, vocab, max_request_tokens, max_output_tokens)
        if req.request_id in seen:
            raise TraceFormatError(lineno, f"duplicate request_id {req.request_id!r}")
        seen.add(req.request_id)
        if prev_arrival is not None and req.arrival_s < prev_arrival:
            raise TraceFormatError(lineno, "arrival_s goes backwards")
        prev_arrival = req.arrival_s
        requests.append(req)
    if header is None:
        raise TraceFormatError(0, "empty file (no header)")
    # ASSUME: a header with zero requests is a valid (empty) trace.
    return Trace(requests, vocab, header.get("name"), header.get("meta"))


def parse_jsonl(lines, **kw):
    """lines: iterable of str (with or without trailing newlines)."""
    data = "".join(l if l.endswith("\n") else l + "\n" for l in lines)
    return parse_bytes(data.encode("utf-8", "surrogatepass"), **kw)


def load_jsonl(path, **kw):
    with open(path, "rb") as f:
        return parse_bytes(f.read(), **kw)


# ----------------------------------------------------------------- writer

def _dump_line(obj):
    return json.dumps(obj, ensure_ascii=False, allow_nan=False, separators=(", ", ": "))


def dump_jsonl(trace):
    head = {"format": FORMAT, "version": VERSION, "vocab_size": trace.vocab_size}
    if trace.name is not None:
        head["name"] = trace.name
    if trace.meta is not None:
        head["meta"] = trace.meta
    out = [_dump_line(head)]
    for r in trace.requests:
        out.append(_dump_line({
            "request_id": r.request_id, "session_id": r.session_id,
            "arrival_s": r.arrival_s, "output_tokens": r.output_tokens,
            "segments": [s.to_json() for s in r.segments]}))
    text = "\n".join(out) + "\n"
    # round-trip self check (the writer refuses to produce what the reader rejects)
    parse_bytes(text.encode("utf-8"))
    return text


def write_jsonl(trace, path):
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        f.write(dump_jsonl(trace))


def summarize(trace):
    toks = [trace.tokens(r) for r in trace.requests]
    return {"requests": len(toks),
            "prompts_sha256": [prompt_sha256(t) for t in toks],
            "prompt_lengths": [len(t) for t in toks],
            "first_tokens": [t[:8] for t in toks]}


if __name__ == "__main__":
    for p in sys.argv[1:]:
        try:
            t = load_jsonl(p)
            print(p, "OK", len(t.requests), "requests")
        except TraceFormatError as e:
            print(p, "ERROR", e)
