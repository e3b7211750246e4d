"""The agent trace: target statistics, structure, JSONL round trip, validation."""

from __future__ import annotations

import io
import itertools
import json
from pathlib import Path

import numpy as np
import pytest

from kvbridge.errors import InvalidArgument
from kvbridge_bench.sim.ideal_cache import IdealPrefixCache
from kvbridge_bench.sim.trace import (
    AgentTraceConfig,
    GenSegment,
    LiteralSegment,
    Trace,
    TraceRequest,
    expand_gen,
    generate_agent_trace,
    hit_stats,
)
from kvbridge_bench.sim.trace_format import TraceFormatError, dump_jsonl, load_jsonl, parse_jsonl


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_full_trace_hits_the_brief(seed: int) -> None:
    tr = generate_agent_trace(AgentTraceConfig(seed=seed))
    st = hit_stats(tr)
    assert st.requests > 500
    assert 0.88 <= st.mean_hit <= 0.93  # "about 90%"
    assert 0.70 <= st.frac_above_95 <= 0.80  # "70-80% of requests above 95%"
    assert 0.02 <= st.frac_below_50 <= 0.15  # a tail of low-hit requests
    assert 48_000 <= st.max_tokens <= 65_536


@pytest.mark.parametrize("seed", [0, 2, 5])
def test_demo_trace_is_small_and_still_agent_like(seed: int) -> None:
    tr = generate_agent_trace(AgentTraceConfig.demo(seed=seed))
    st = hit_stats(tr)
    assert 20 <= st.requests <= 120 and st.max_tokens <= 2048
    assert 0.85 <= st.mean_hit <= 0.95
    assert st.frac_above_95 >= 0.6


def test_generator_is_seeded() -> None:
    a = generate_agent_trace(AgentTraceConfig.demo(seed=3))
    b = generate_agent_trace(AgentTraceConfig.demo(seed=3))
    c = generate_agent_trace(AgentTraceConfig.demo(seed=4))
    assert a.requests == b.requests
    assert a.requests != c.requests


def test_sessions_share_system_prompts_and_grow() -> None:
    tr = generate_agent_trace(AgentTraceConfig.demo(seed=0))
    arrivals = [r.arrival_s for r in tr.requests]
    assert arrivals == sorted(arrivals)
    by_session: dict[str, list[TraceRequest]] = {}
    for r in tr.requests:
        by_session.setdefault(r.session_id, []).append(r)
    firsts = {s[0].segments[0] for s in by_session.values()}
    assert len(firsts) < len(by_session)  # some sessions share a system prompt
    grew = 0
    for reqs in by_session.values():
        for prev, cur in itertools.pairwise(reqs):
            assert cur.segments[0] == prev.segments[0]  # same system prompt throughout
            if cur.segments[: len(prev.segments)] == prev.segments:
                grew += 1
                # the previous answer and a tool output are appended
                assert cur.segments[len(prev.segments)].length == prev.output_tokens
    assert grew >= len(tr) // 2


def test_expand_gen_matches_the_documented_splitmix64() -> None:
    def ref(seed: int, n: int, vocab: int) -> list[int]:
        m = (1 << 64) - 1
        out = []
        for i in range(1, n + 1):
            z = (seed + i * 0x9E3779B97F4A7C15) & m
            z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & m
            z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & m
            out.append((z ^ (z >> 31)) % vocab)
        return out

    for seed in (0, 1, 12345, (1 << 64) - 1):
        assert expand_gen(seed, 50, 128256).tolist() == ref(seed, 50, 128256)
    assert expand_gen(7, 5, 1000).tolist() == ref(7, 5, 1000)
    assert expand_gen(7, 3, 1000).tolist() == ref(7, 5, 1000)[:3]  # prefixes are shared


def test_ideal_cache_is_token_exact() -> None:
    rng = np.random.default_rng(0)
    seen: list[list[int]] = []
    cache = IdealPrefixCache()
    for _ in range(300):
        if seen and rng.random() < 0.7:
            base = seen[int(rng.integers(len(seen)))]
            cut = int(rng.integers(0, len(base) + 1))
            seq = base[:cut] + [int(x) for x in rng.integers(0, 3, int(rng.integers(0, 40)))]
        else:
            seq = [int(x) for x in rng.integers(0, 3, int(rng.integers(0, 60)))]
        expect = 0
        for s in seen:
            n = 0
            while n < min(len(s), len(seq)) and s[n] == seq[n]:
                n += 1
            expect = max(expect, n)
        assert cache.match_and_insert(seq) == expect
        seen.append(seq)


def test_jsonl_round_trip(tmp_path: Path) -> None:
    tr = generate_agent_trace(AgentTraceConfig.demo(seed=1))
    tr.requests.append(
        TraceRequest("lit", "user", tr.requests[-1].arrival_s + 1, 3, (LiteralSegment((1, 2)),))
    )
    path = tmp_path / "t.jsonl"
    from kvbridge_bench.sim.trace_format import write_jsonl

    write_jsonl(tr, path)
    back = load_jsonl(path)
    assert back.requests == tr.requests and back.vocab_size == tr.vocab_size
    assert back.meta == json.loads(json.dumps(tr.meta))
    for a, b in zip(tr.requests, back.requests, strict=True):
        assert np.array_equal(tr.tokens(a), back.tokens(b))
    assert load_jsonl(io.StringIO(dump_jsonl(tr))).requests == tr.requests


HEADER = '{"format":"kvbridge-trace","version":1,"vocab_size":100}'
GOOD = '{"request_id":"a","session_id":"s","arrival_s":0,"output_tokens":5,"segments":[{"gen":[1,10]}]}'


def line(**changes: object) -> str:
    rec = json.loads(GOOD)
    for k, v in changes.items():
        if v is None:
            del rec[k]
        else:
            rec[k] = v
    return json.dumps(rec)


@pytest.mark.parametrize(
    ("lines", "bad_line"),
    [
        ([], 0),
        ([GOOD], 1),  # no header
        (['{"format":"kvbridge-trace","version":2,"vocab_size":100}', GOOD], 1),
        (['{"format":"kvbridge-trace","version":1,"vocab_size":1}', GOOD], 1),
        (['{"format":"kvbridge-trace","version":1,"vocab_size":100,"x":1}'], 1),
        ([HEADER, "{not json"], 2),
        ([HEADER, "[1, 2]"], 2),
        ([HEADER, line(request_id=None)], 2),
        ([HEADER, line(extra=1)], 2),
        ([HEADER, line(request_id="")], 2),
        ([HEADER, line(arrival_s=-1)], 2),
        ([HEADER, line(arrival_s="soon")], 2),
        ([HEADER, line(output_tokens=True)], 2),
        ([HEADER, line(output_tokens=-3)], 2),
        ([HEADER, line(segments=[])], 2),
        ([HEADER, line(segments=[{"gen": [1, 0]}])], 2),
        ([HEADER, line(segments=[{"gen": [-1, 4]}])], 2),
        ([HEADER, line(segments=[{"gen": [1, 4], "tokens": [1]}])], 2),
        ([HEADER, line(segments=[{"tokens": [1, 100]}])], 2),  # id >= vocab
        ([HEADER, line(segments=[{"tokens": [1.5]}])], 2),
        ([HEADER, line(segments=[{"zip": "x"}])], 2),
        ([HEADER, line(segments=[{"gen": [1, 70]}])], 2),  # over max_request_tokens
        ([HEADER, GOOD, GOOD], 3),  # duplicate request id
        ([HEADER, line(arrival_s=5), line(request_id="b", arrival_s=4)], 3),
    ],
)
def test_bad_lines_rejected(lines: list[str], bad_line: int) -> None:
    with pytest.raises(TraceFormatError) as ei:
        parse_jsonl(lines, max_request_tokens=64)
    assert ei.value.line == bad_line
    assert isinstance(ei.value, InvalidArgument)


def test_blank_lines_and_literal_tokens_accepted() -> None:
    tr = parse_jsonl([HEADER, "", line(segments=[{"tokens": [5, 6]}, {"gen": [9, 3]}])])
    assert len(tr) == 1
    toks = tr.tokens(tr.requests[0])
    assert toks[:2].tolist() == [5, 6] and toks.size == 5 and int(toks.max()) < 100


def test_user_trace_statistics() -> None:
    reqs = [
        TraceRequest("1", "s", 0.0, 4, (GenSegment(1, 100),)),
        TraceRequest("2", "s", 1.0, 4, (GenSegment(1, 100), GenSegment(2, 100))),
    ]
    st = hit_stats(Trace(reqs, vocab_size=1000))
    assert st.mean_hit == pytest.approx(0.25) and st.token_hit == pytest.approx(100 / 300)
    with pytest.raises(InvalidArgument):
        hit_stats(Trace(reqs), hits=[1])
