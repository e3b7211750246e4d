"""docs/trace-format.md against trace files written from that page alone
(tests/spec_peer/traces, an independent implementation written from the document alone): kvbridge's
loader reads every valid file to the same prompts (sha256 of the int32
token ids), rejects every invalid one with TraceFormatError at the line the
page names, and decides the cases the page left open (ambiguous/) the way
the page now states."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest

from kvbridge_bench.sim.trace_format import TraceFormatError, dump_jsonl, load_jsonl, parse_jsonl

ROOT = Path(__file__).parent / "spec_peer" / "traces"


def _files(group: str) -> list[Path]:
    return sorted((ROOT / group).glob("*.jsonl"))


def _expect(f: Path) -> dict[str, object]:
    return dict(json.loads(Path(f"{f}.expect.json").read_text()))


@pytest.mark.parametrize("path", _files("valid"), ids=lambda p: p.name)
def test_valid_traces_load_to_the_same_prompts(path: Path) -> None:
    exp = _expect(path)
    tr = load_jsonl(path)
    assert len(tr.requests) == exp["requests"]
    got = [tr.tokens(r) for r in tr.requests]
    assert [len(t) for t in got] == exp["prompt_lengths"]
    assert [[int(x) for x in t[:8]] for t in got] == exp["first_tokens"]
    digests = [hashlib.sha256(np.asarray(t, "<i4").tobytes()).hexdigest() for t in got]
    assert digests == exp["prompts_sha256"]
    again = parse_jsonl(dump_jsonl(tr).splitlines(keepends=True))  # the writer round-trips
    assert [again.tokens(r).tobytes() for r in again.requests] == [t.tobytes() for t in got]


@pytest.mark.parametrize("path", _files("invalid"), ids=lambda p: p.name)
def test_invalid_traces_fail_at_the_named_line(path: Path) -> None:
    with pytest.raises(TraceFormatError) as e:
        load_jsonl(path)
    assert e.value.line == _expect(path)["line"]


@pytest.mark.parametrize("path", _files("ambiguous"), ids=lambda p: p.name)
def test_cases_the_page_left_open_are_decided_as_it_now_says(path: Path) -> None:
    exp = _expect(path)
    if exp["my_assumption"] == "valid":
        load_jsonl(path)
    else:
        with pytest.raises(TraceFormatError) as e:
            load_jsonl(path)
        if exp.get("line") is not None:
            assert e.value.line == exp["line"]
