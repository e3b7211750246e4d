"""No process or namespace outlives the demo: the roles die with their
parent (even a parent killed by SIGKILL), a role stops promptly on SIGTERM
even while its engine's worker thread is busy, and a driver stopped by
SIGTERM runs its cleanup (roles, forwarder, network namespaces)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

pytest.importorskip("kvbridge._core")

from kvbridge_bench.demo.lifecycle import PARENT_ENV, child_env

NS_DIR = Path("/run/netns")


def _alive(pid: int) -> bool:
    """Running (a zombie that nobody reaped counts as gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _wait_gone(pids: list[int], timeout_s: float) -> list[int]:
    deadline = time.monotonic() + timeout_s
    left = [p for p in pids if _alive(p)]
    while left and time.monotonic() < deadline:
        time.sleep(0.05)
        left = [p for p in left if _alive(p)]
    return left


def _children(pid: int) -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                stat = (d / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(d.name))
    return out


def _namespaces_of(pid: int) -> list[str]:
    if not NS_DIR.is_dir():
        return []
    return [n for n in os.listdir(NS_DIR) if n.startswith(f"kvbemu{pid}x")]


# the parent: starts the three roles as the driver does (the random model),
# waits until each answers, prints their pids and namespaces, then sleeps
PARENT = textwrap.dedent(
    """
    import asyncio, json, os, sys, tempfile
    from pathlib import Path
    from kvbridge_bench.demo.config import DemoConfig
    from kvbridge_bench.demo.control import ControlClient
    from kvbridge_bench.demo.driver import RoleProcesses
    from kvbridge_bench.sim.emulator import WanEmulator

    mode = "netns" if WanEmulator.available()[0] else "proxy"
    cfg = DemoConfig.smoke().replace(rld_transport="tcp")
    tmp = tempfile.mkdtemp(prefix="kvb-life-")
    cfg_path = os.path.join(tmp, "config.json")
    Path(cfg_path).write_text(cfg.to_json())
    socks = {r: os.path.join(tmp, r + ".sock") for r in ("p", "rld", "md")}
    roles = RoleProcesses()
    roles.start(cfg, mode, cfg_path, socks)

    async def up():
        for r in ("md", "rld", "p"):
            c = ControlClient(socks[r])
            await c.connect(timeout=120.0)
            await c.call("ping", timeout=60.0)
            await c.close()

    asyncio.run(up())
    ns = [roles.emu.namespace("a"), roles.emu.namespace("b")] if roles.emu else []
    fwd = roles.emu._fwd.pid if roles.emu else None
    print(json.dumps({"roles": [p.pid for p in roles.procs], "ns": ns, "fwd": fwd}), flush=True)
    sys.stdin.read()  # until the test kills this process
    """
)


@pytest.mark.timeout(240)
def test_roles_die_with_a_parent_killed_by_sigkill() -> None:
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert parent.stdout is not None
        line = parent.stdout.readline()
        assert line, f"the parent exited early (code {parent.wait(30)})"
        info = json.loads(line)
        pids = list(info["roles"])
        assert len(pids) == 3 and all(_alive(p) for p in pids)
        parent.send_signal(signal.SIGKILL)
        parent.wait(10)
        left = _wait_gone(pids + ([info["fwd"]] if info["fwd"] else []), 10.0)
        assert not left, f"still running after the parent's SIGKILL: {left}"
        deadline = time.monotonic() + 15.0
        while any((NS_DIR / n).exists() for n in info["ns"]) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [n for n in info["ns"] if (NS_DIR / n).exists()], "namespaces left"
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()
        for f in (parent.stdin, parent.stdout):
            if f is not None:
                f.close()


@pytest.mark.timeout(120)
def test_role_exits_promptly_on_sigterm_with_its_worker_busy(tmp_path: Path) -> None:
    """The prefill's worker thread computes for many seconds (a long warm-up
    of the prefix cache); SIGTERM still ends the process within 3 s."""
    from kvbridge_bench.demo.config import DemoConfig

    cfg = DemoConfig.smoke().replace(
        rld_transport="tcp",
        num_layers=6,
        hidden_size=512,
        num_heads=8,
        head_dim=64,
        intermediate_size=1536,
        p_pages=2048,
    )
    cfg_path = tmp_path / "config.json"
    cfg_path.write_text(cfg.to_json())
    sock = str(tmp_path / "p.sock")
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvbridge_bench.demo.roles", "p", str(cfg_path), sock],
        env=child_env(),
    )
    caller: subprocess.Popen[str] | None = None
    try:
        script = textwrap.dedent(
            f"""
            import asyncio, random
            from kvbridge_bench.demo.control import ControlClient
            async def main():
                c = ControlClient({sock!r})
                await c.connect(timeout=60.0)
                await c.call("ping", timeout=30.0)
                print("up", flush=True)
                rng = random.Random(0)
                prompts = [[rng.randrange(2048) for _ in range(700)] for _ in range(40)]
                try:
                    await c.call("warm", prompts=prompts, timeout=120.0)
                except Exception:
                    pass
            asyncio.run(main())
            """
        )
        caller = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
        assert caller.stdout is not None and caller.stdout.readline().strip() == "up"
        # wait until the worker is busy: the role computes for a CPU second
        ticks = _cpu_ticks(proc.pid)
        deadline = time.monotonic() + 90.0
        while _cpu_ticks(proc.pid) - ticks < 100 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _cpu_ticks(proc.pid) - ticks >= 100, "the prefill never got busy"
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=10)
        took = time.monotonic() - t0
        assert took < 3.5, f"the role took {took:.1f} s to exit on SIGTERM"
        caller.wait(timeout=30)
    finally:
        for p in [x for x in (proc, caller) if x is not None]:
            if p.poll() is None:
                p.kill()
                p.wait()
            if p.stdout is not None:
                p.stdout.close()


def _cpu_ticks(pid: int) -> int:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime + stime


def test_role_refuses_to_start_after_its_parent_died(tmp_path: Path) -> None:
    """A role whose parent died before it asked for PR_SET_PDEATHSIG exits."""
    env = dict(os.environ)
    env[PARENT_ENV] = "1"  # never this process's parent
    proc = subprocess.run(
        [sys.executable, "-m", "kvbridge_bench.demo.roles", "p", "/nonexistent", "/nonexistent"],
        env=env,
        timeout=60,
        capture_output=True,
    )
    assert proc.returncode == 128 + signal.SIGTERM, proc.stderr


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_demo_driver_cleans_up_on_sigterm() -> None:
    """``kvbridge-bench demo`` stopped by SIGTERM (as ``pkill -f`` sends it)
    mid-run: it exits, and none of its processes or namespaces is left."""
    exe = Path(sys.executable).with_name("kvbridge-bench")
    drv = subprocess.Popen(
        [str(exe), "demo", "--smoke", "--no-progress", "--relay-transport", "tcp"],
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        assert drv.stdout is not None
        deadline = time.monotonic() + 200
        for line in drv.stdout:
            if "roles up" in line or time.monotonic() > deadline:
                break
        assert drv.poll() is None, "the demo ended before its roles were up"
        time.sleep(2.0)  # into the first replay
        kids = _children(drv.pid)
        grandkids = [g for k in kids for g in _children(k)]
        ns = _namespaces_of(drv.pid)
        assert len(kids) >= 3
        t0 = time.monotonic()
        drv.send_signal(signal.SIGTERM)
        code = drv.wait(timeout=30)
        took = time.monotonic() - t0
        assert code == 130, code
        assert took < 20, took
        left = _wait_gone(kids + grandkids, 10.0)
        assert not left, f"left running: {left}"
        deadline = time.monotonic() + 15
        while _namespaces_of(drv.pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _namespaces_of(drv.pid), ns
    finally:
        if drv.poll() is None:
            drv.kill()
            drv.wait()
        if drv.stdout is not None:
            drv.stdout.close()
