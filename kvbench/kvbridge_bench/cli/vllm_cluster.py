"""Three vLLM engines with kvbridge's connector, a WAN between them, and the
proxy: what ``make test-vllm`` and ``kvbridge-bench demo --engine vllm`` run.

- prefill ``P`` (``kv_producer``, block size ``p_block``);
- relay decode ``RLD`` (``kv_consumer``, same datacenter: UCX where kvbridge
  has it, else local TCP);
- main decode ``MD`` (``kv_consumer``, across the emulated WAN: P's kvbridge
  TCP connection to MD goes through a :class:`ProxyEmulator` with the given
  rate and round trip, run on a thread of this process);
- the proxy (``python -m kvbridge.integrations.vllm.proxy``).

Every process is started with the command lines that docs/vllm.md prints
(:meth:`VllmCluster.commands`), and :meth:`VllmCluster.stop` ends them all.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from kvbridge.errors import ConnectTimeout, KVBridgeError, Unavailable
from kvbridge.integrations.vllm.launch import ServerSpec, VllmServer, kv_transfer_config

from ..sim.emulator import ProxyEmulator

__all__ = [
    "ClusterSpec",
    "Completion",
    "EmulatorThread",
    "ServerSpec",
    "VllmCluster",
    "VllmServer",
    "complete",
    "free_port",
    "metric_sum",
    "reference_outputs",
]

IDENT = {"p": "prefill-0", "rld": "rld", "md": "md"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# ---- HTTP helpers ------------------------------------------------------------------
@dataclass
class Completion:
    text: str
    token_ids: list[int]
    finish_reason: str | None
    chunks: int = 0
    ttft_s: float | None = None
    seconds: float = 0.0
    error: str | None = None
    kv_transfer_params: dict[str, Any] | None = None
    raw: dict[str, Any] = field(default_factory=dict)
    arrivals: list[float] = field(default_factory=list)  # seconds after the request, per token


def complete(
    url: str,
    body: dict[str, Any],
    *,
    path: str = "/v1/completions",
    timeout: float = 300.0,
) -> Completion:
    """POST a completion (streaming when ``body["stream"]``); token IDs are
    asked for (``return_token_ids``, a vLLM extension the proxy keeps)."""
    body = {"return_token_ids": True, **body}
    req = urllib.request.Request(
        url + path, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    t0 = time.perf_counter()
    try:
        resp = urllib.request.urlopen(req, timeout=timeout)
    except urllib.error.HTTPError as e:
        return Completion("", [], None, error=f"HTTP {e.code}: {e.read().decode(errors='replace')}")
    with resp:
        if not body.get("stream"):
            data = json.loads(resp.read())
            ch = data["choices"][0]
            text = ch.get("text")
            if text is None:
                text = (ch.get("message") or {}).get("content") or ""
            return Completion(
                text,
                list(ch.get("token_ids") or []),
                ch.get("finish_reason"),
                seconds=time.perf_counter() - t0,
                kv_transfer_params=data.get("kv_transfer_params"),
                raw=data,
            )
        out = Completion("", [], None)
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data:"):
                continue
            data_s = line[5:].strip()
            if data_s == "[DONE]":
                break
            ev = json.loads(data_s)
            if "error" in ev:
                out.error = str(ev["error"])
                continue
            for ch in ev.get("choices") or ():
                ids = list(ch.get("token_ids") or [])
                now = time.perf_counter() - t0
                if ids and out.ttft_s is None:
                    out.ttft_s = now
                out.arrivals += [now] * len(ids)
                out.token_ids += ids
                out.text += ch.get("text") or (ch.get("delta") or {}).get("content") or ""
                out.finish_reason = ch.get("finish_reason") or out.finish_reason
                out.chunks += 1
        out.seconds = time.perf_counter() - t0
        return out


def get_json(url: str, timeout: float = 30.0) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read())


def post_json(url: str, body: dict[str, Any], timeout: float = 30.0) -> Any:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read() or b"{}")


def metric_sum(url: str, name: str, **labels: str) -> float:
    """The sum of a Prometheus series on ``url/metrics`` (``name`` without
    ``_total``), over the series whose labels include ``labels``."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as r:
        text = r.read().decode()
    total = 0.0
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name not in (name, f"{name}_total"):
                continue
            if all(s.labels.get(k) == v for k, v in labels.items()):
                total += float(s.value)
    return total


# ---- the WAN -----------------------------------------------------------------------
class EmulatorThread:
    """A :class:`ProxyEmulator` on an event loop of its own thread."""

    def __init__(self, target: tuple[str, int], rate_bps: float, rtt_ms: float) -> None:
        self.target = target
        self.rate_bps = rate_bps
        self.rtt_ms = rtt_ms
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True, name="wan")
        self.emu: ProxyEmulator | None = None

    def _call(self, coro: Any, timeout: float = 10.0) -> Any:
        fut: Future[Any] = asyncio.run_coroutine_threadsafe(coro, self._loop)
        return fut.result(timeout)

    def start(self) -> EmulatorThread:
        self._thread.start()

        async def run() -> ProxyEmulator:
            emu = ProxyEmulator(self.target, rate_bps=self.rate_bps, rtt_ms=self.rtt_ms)
            await emu.start()
            return emu

        self.emu = self._call(run())
        return self

    @property
    def listen(self) -> tuple[str, int]:
        assert self.emu is not None
        host, port = self.emu.listen_addr[:2]
        return str(host), int(port)

    def stats(self) -> dict[str, int]:
        assert self.emu is not None
        emu = self.emu

        async def read() -> dict[str, int]:
            return emu.stats()

        out: dict[str, int] = self._call(read())
        return out

    def set_rate(self, rate_bps: float) -> None:
        """Change the line rate of both directions (bytes on the way keep their times)."""
        assert self.emu is not None
        emu = self.emu

        async def change() -> None:
            for line in emu._lines.values():
                line.update(line.params.with_(rate_bps=float(rate_bps)))

        self._call(change())
        self.rate_bps = rate_bps

    def stop(self) -> None:
        if self.emu is not None:
            with contextlib.suppress(Exception):
                self._call(self.emu.close())
            self.emu = None
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)
        self._loop.close()


# ---- the cluster -------------------------------------------------------------------
@dataclass
class ClusterSpec:
    model_dir: str
    workdir: Path
    python: str = sys.executable
    relay: bool = True
    p_block: int = 32
    md_block: int = 64
    rld_block: int = 32
    wan_rate_bps: float = 2e8
    wan_rtt_ms: float = 40.0
    md_policy: str = "recompute"
    rld_policy: str = "recompute"
    recv_timeout_s: float = 30.0
    ticket_timeout_s: float = 20.0
    served_model_name: str = "smollm2"
    dtype: str = "bfloat16"
    host: str = "127.0.0.1"
    max_model_len: int = 2048
    num_blocks: int = 512  # per engine, of p_block tokens (the decodes scale it)
    ucx: bool | None = None  # None: UCX for the relay where kvbridge has it
    wan: bool = True  # False: the prefill reaches the main decode directly
    proxy_args: list[str] = field(default_factory=list)


def ucx_available() -> bool:
    from kvbridge.transport import ucx

    return bool(ucx.available())


class VllmCluster:
    def __init__(self, spec: ClusterSpec) -> None:
        self.spec = spec
        spec.workdir.mkdir(parents=True, exist_ok=True)
        self.ports = {k: free_port() for k in ("p", "md", "rld", "md_kvb", "rld_kvb", "proxy")}
        self.use_ucx = ucx_available() if spec.ucx is None else spec.ucx
        self.wan: EmulatorThread | None = None
        self.servers: dict[str, VllmServer] = {}
        self.proxy: subprocess.Popen[bytes] | None = None
        self._proxy_log: Any = None
        self._restarts = 0

    # ---- specs (the operator's commands) -----------------------------------------------
    def _decode_spec(self, role: str) -> ServerSpec:
        s = self.spec
        block = s.md_block if role == "md" else s.rld_block
        extra: dict[str, Any] = {
            "identity": IDENT[role],
            "listen": f"{s.host}:{self.ports[role + '_kvb']}",
            "recv_timeout_s": s.recv_timeout_s,
        }
        if role == "rld" and self.use_ucx:
            extra["ucx"] = True
        policy = s.md_policy if role == "md" else s.rld_policy
        return ServerSpec(
            IDENT[role],
            s.model_dir,
            self.ports[role],
            host=s.host,
            served_model_name=s.served_model_name,
            dtype=s.dtype,
            kv=kv_transfer_config("kv_consumer", extra, failure_policy=policy),
            block_size=block,
            max_model_len=s.max_model_len,
            num_blocks=max(16, s.num_blocks * s.p_block // block),
        )

    def prefill_spec(self, md_addr: tuple[str, int] | None = None) -> ServerSpec:
        s = self.spec
        host, port = md_addr or (self.wan.listen if self.wan else (s.host, self.ports["md_kvb"]))
        peers: dict[str, Any] = {"md": f"{host}:{port}"}
        if s.relay:
            peers["rld"] = {
                "addr": f"{s.host}:{self.ports['rld_kvb']}",
                "transport": "ucx" if self.use_ucx else "tcp",
            }
        extra = {
            "identity": IDENT["p"],
            "peers": peers,
            "ticket_timeout_s": s.ticket_timeout_s,
            "reconnect_timeout_s": 3.0,
        }
        return ServerSpec(
            IDENT["p"],
            s.model_dir,
            self.ports["p"],
            host=s.host,
            served_model_name=s.served_model_name,
            dtype=s.dtype,
            kv=kv_transfer_config("kv_producer", extra),
            block_size=s.p_block,
            max_model_len=s.max_model_len,
            num_blocks=s.num_blocks,
        )

    def proxy_argv(self) -> list[str]:
        s = self.spec
        a = [
            s.python,
            "-m",
            "kvbridge.integrations.vllm.proxy",
            "--host",
            s.host,
            "--port",
            str(self.ports["proxy"]),
            "--prefill",
            f"{IDENT['p']}=http://{s.host}:{self.ports['p']}",
            "--main",
            f"{IDENT['md']}=http://{s.host}:{self.ports['md']}",
            "--model",
            s.served_model_name,
            "--model-dir",
            s.model_dir,
            "--md-block-size",
            str(s.md_block),
        ]
        if s.relay:
            a += ["--relay", f"{IDENT['rld']}=http://{s.host}:{self.ports['rld']}"]
        return a + list(s.proxy_args)

    def commands(self) -> dict[str, str]:
        """The shell commands of every process, as docs/vllm.md shows them."""
        out = {"md": self._decode_spec("md").command_line()}
        if self.spec.relay:
            out["rld"] = self._decode_spec("rld").command_line()
        out["p"] = self.prefill_spec().command_line()
        out["proxy"] = " ".join(["python", *self.proxy_argv()[1:]])
        return out

    @property
    def bytes_per_token(self) -> int:
        """KV bytes per token of the model at the cluster's dtype."""
        cfg = json.loads((Path(self.spec.model_dir) / "config.json").read_text())
        heads = int(cfg.get("num_key_value_heads") or cfg["num_attention_heads"])
        dim = int(cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"])
        item = 4 if self.spec.dtype in ("float32", "float") else 2
        return int(cfg["num_hidden_layers"]) * 2 * heads * dim * item

    # ---- lifecycle ---------------------------------------------------------------------
    @property
    def url(self) -> str:
        return f"http://{self.spec.host}:{self.ports['proxy']}"

    def engine_url(self, role: str) -> str:
        return f"http://{self.spec.host}:{self.ports[role]}"

    def _server(self, role: str, spec: ServerSpec) -> VllmServer:
        log = self.spec.workdir / f"{role}-{self._restarts}.log"
        return VllmServer(spec, python=self.spec.python, log_path=log)

    def start(self, timeout: float = 420.0) -> VllmCluster:
        s = self.spec
        try:
            if s.wan:
                self.wan = EmulatorThread(
                    (s.host, self.ports["md_kvb"]), s.wan_rate_bps, s.wan_rtt_ms
                )
                self.wan.start()
            roles = ["md", "rld"] if s.relay else ["md"]
            for role in roles:
                self.servers[role] = self._server(role, self._decode_spec(role)).start()
            self.servers["p"] = self._server("p", self.prefill_spec()).start()
            deadline = time.monotonic() + timeout
            for srv in self.servers.values():
                srv.wait_ready(max(1.0, deadline - time.monotonic()))
            self.start_proxy()
            return self
        except BaseException:
            self.stop()
            raise

    def start_proxy(self, timeout: float = 30.0, attempts: int = 3) -> None:
        """Start the proxy on a port picked now (another process may have
        taken the one picked at construction); a lost race is retried."""
        if self._proxy_log is None:
            self._proxy_log = open(self.spec.workdir / "proxy.log", "ab")  # noqa: SIM115 (closed in stop)
        for _ in range(attempts):
            self.ports["proxy"] = free_port()
            self.proxy = subprocess.Popen(
                self.proxy_argv(), stdout=self._proxy_log, stderr=subprocess.STDOUT
            )
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline and self.proxy.poll() is None:
                with contextlib.suppress(OSError, urllib.error.URLError):
                    if get_json(self.url + "/health", timeout=2).get("status") == "ok":
                        return
                time.sleep(0.3)
            if self.proxy.poll() is None:
                raise ConnectTimeout("the proxy did not come up; see proxy.log")
        raise Unavailable("the proxy exited; see proxy.log")

    def kill_prefill(self) -> None:
        self.servers["p"].kill()
        self.servers["p"].stop(grace=5)

    def restart_prefill(self, timeout: float = 300.0) -> None:
        self.kill_prefill()
        self._restarts += 1
        self.servers["p"] = self._server("p", self.prefill_spec()).start()
        self.servers["p"].wait_ready(timeout)

    def wait_connected(self, timeout: float = 60.0) -> None:
        """Until the prefill's kvbridge connections are up (one warm-up request
        per pipeline that must end at the main decode)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            c = complete(self.url, {"model": "x", "prompt": "Hello", "max_tokens": 2})
            if c.error is None and c.token_ids:
                return
            time.sleep(1.0)
        raise Unavailable("the cluster does not serve requests")

    def stop(self) -> None:
        if self.proxy is not None:
            self.proxy.terminate()
            try:
                self.proxy.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proxy.kill()
                self.proxy.wait(timeout=5)
            self.proxy = None
        if self._proxy_log is not None:
            self._proxy_log.close()
            self._proxy_log = None
        for srv in self.servers.values():
            srv.stop()
        self.servers.clear()
        if self.wan is not None:
            self.wan.stop()
            self.wan = None

    def __enter__(self) -> VllmCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def logs(self) -> Iterator[tuple[str, str]]:
        for p in sorted(self.spec.workdir.glob("*.log")):
            yield p.name, "\n".join(p.read_text(errors="replace").splitlines()[-30:])


def reference_outputs(
    model_dir: str,
    prompts: list[list[int]],
    *,
    max_tokens: int,
    workdir: Path,
    python: str = sys.executable,
    block_size: int = 64,
    max_model_len: int = 2048,
) -> list[Completion]:
    """Greedy outputs of one plain vLLM instance alone (no connector)."""
    spec = ServerSpec(
        "reference",
        model_dir,
        free_port(),
        block_size=block_size,
        max_model_len=max_model_len,
        num_blocks=256,
    )
    srv = VllmServer(spec, python=python, log_path=workdir / "reference.log").start()
    try:
        srv.wait_ready()
        out = []
        for ids in prompts:
            body = {"model": "smollm2", "prompt": ids, "max_tokens": max_tokens, "temperature": 0}
            c = complete(srv.url, body)
            if c.error:
                raise KVBridgeError(f"reference instance: {c.error}")
            out.append(c)
        return out
    finally:
        srv.stop()


def with_spec(spec: ClusterSpec, **changes: Any) -> ClusterSpec:
    return replace(spec, **changes)
