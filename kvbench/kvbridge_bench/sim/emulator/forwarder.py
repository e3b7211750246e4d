"""The packet forwarder: a process that moves raw IP packets between two TUN
devices through one :class:`~.link.Link` per direction.

It is started by :class:`~.wan.WanEmulator` with both TUN fds inherited and
its configuration as one JSON argument.  It talks JSON lines: it prints
``{"ready": true}`` once, then answers commands read from stdin:
``{"op": "stats"}``, ``{"op": "set", "ab": {...}, "ba": {...}}`` (new
:class:`~.params.LinkParams`, either side optional) and ``{"op": "quit"}``.
End of stdin (its owner died) ends it too.

One thread, level-triggered epoll, batched non-blocking reads, and one FIFO
per direction ordered by delivery time (a heap when reordering is allowed).
The poll timeout is the next delivery time, rounded up to a millisecond.
"""

from __future__ import annotations

import json
import os
import random
import select
import sys
import time
from typing import Any

from .link import Link
from .params import LinkParams

READ_BATCH = 128


class Forwarder:
    def __init__(
        self,
        fd_a: int,
        fd_b: int,
        ab: Link,
        ba: Link,
        ctrl_in: int,
        ctrl_out: Any,
    ) -> None:
        self.fd_a, self.fd_b = fd_a, fd_b
        self.ab, self.ba = ab, ba
        self.ctrl_in = ctrl_in
        self.ctrl_out = ctrl_out
        self._ctrl_buf = b""
        self._running = True
        self._bufsize = max(ab.mtu, ba.mtu) + 64

    def _reply(self, obj: dict[str, Any]) -> None:
        self.ctrl_out.write(json.dumps(obj) + "\n")
        self.ctrl_out.flush()

    def _control(self) -> None:
        data = os.read(self.ctrl_in, 65536)
        if not data:
            self._running = False
            return
        self._ctrl_buf += data
        while b"\n" in self._ctrl_buf:
            line, self._ctrl_buf = self._ctrl_buf.split(b"\n", 1)
            if line.strip():
                self._command(line)

    def _command(self, line: bytes) -> None:
        try:
            cmd = json.loads(line)
            op = cmd.get("op")
            if op == "stats":
                self._reply(
                    {
                        "ab": self.ab.stats.to_dict() | {"held": self.ab.held()},
                        "ba": self.ba.stats.to_dict() | {"held": self.ba.held()},
                    }
                )
            elif op == "set":
                if "ab" in cmd:
                    self.ab.update(LinkParams.from_dict(cmd["ab"]))
                if "ba" in cmd:
                    self.ba.update(LinkParams.from_dict(cmd["ba"]))
                self._reply({"ok": True})
            elif op == "quit":
                self._reply({"ok": True})
                self._running = False
            else:
                self._reply({"error": f"unknown op {op!r}"})
        except Exception as exc:  # a bad command must not stop the line
            self._reply({"error": repr(exc)})

    def run(self) -> None:
        ep = select.epoll()
        fd_a, fd_b, ab, ba = self.fd_a, self.fd_b, self.ab, self.ba
        ep.register(fd_a, select.EPOLLIN)
        ep.register(fd_b, select.EPOLLIN)
        ep.register(self.ctrl_in, select.EPOLLIN)
        routes = {fd_a: ab, fd_b: ba}
        outs = ((ab, fd_b), (ba, fd_a))
        read, write, monotonic = os.read, os.write, time.monotonic
        bufsize = self._bufsize
        self._reply({"ready": True})
        try:
            while self._running:
                d1, d2 = ab.next_due(), ba.next_due()
                due = d1 if d2 is None else (d2 if d1 is None or d2 < d1 else d1)
                timeout = -1.0 if due is None else max(0.0, due - monotonic())
                events = ep.poll(timeout)
                now = monotonic()
                for fd, _ in events:
                    link = routes.get(fd)
                    if link is None:
                        self._control()
                        continue
                    for _ in range(READ_BATCH):
                        try:
                            pkt = read(fd, bufsize)
                        except BlockingIOError:
                            break
                        link.push(now, pkt)
                now = monotonic()
                for link, out in outs:
                    if link.held():
                        st = link.stats
                        for pkt in link.pop_due(now):
                            try:
                                write(out, pkt)
                                st.packets_out += 1
                                st.bytes_out += len(pkt)
                            except OSError:
                                st.write_errors += 1
        finally:
            ep.close()


def main(argv: list[str]) -> int:
    cfg = json.loads(argv[0])
    mtu = int(cfg["mtu"])
    rtt = float(cfg["rtt_s"])
    seed = cfg.get("seed")
    rng_ab = random.Random(seed)
    rng_ba = random.Random(None if seed is None else seed + 1)
    ab = Link(LinkParams.from_dict(cfg["ab"]), mtu, rtt, rng_ab)
    ba = Link(LinkParams.from_dict(cfg["ba"]), mtu, rtt, rng_ba)
    fwd = Forwarder(int(cfg["fd_a"]), int(cfg["fd_b"]), ab, ba, sys.stdin.fileno(), sys.stdout)
    try:
        fwd.run()
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
