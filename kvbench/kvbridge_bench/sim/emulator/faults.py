"""FaultProxy: an application-level fault injector on loopback.

    proxy = FaultProxy(target=("127.0.0.1", port))
    proxy.add(ResetAfter(1 << 20, conns=[0]))   # reset the first connection after 1 MiB
    proxy.add(FlipBits(offset=12345))           # flip one bit of every connection
    proxy.add(CorruptFrame("seq", frames=[3]))  # one bit of the 4th DATA frame's seq
    async with proxy:
        ...connect to proxy.listen_addr...
    proxy.stats.resets, proxy.stats.bits_flipped, proxy.stats.events

Faults are matched against each accepted connection by its 0-based index
(``conns=None`` means every connection) when it is accepted, so a test can
change the program between connections.  Byte offsets count the bytes of one
direction of one connection: ``"c2s"`` (client to server) or ``"s2c"``.

Byte faults: :class:`ResetAfter` (RST), :class:`Stall` (one direction stops
for a while), :class:`HalfClose` (FIN one way, the other flows on),
:class:`Blackhole` (both directions stop, the connection stays open: a
silent peer), :class:`FlipBits` (bit flips at offsets or at random),
:class:`DropAtAccept`.  Frame faults (:class:`CorruptFrame`) parse the
client's bytes as kvbridge frames (docs/protocol.md, plaintext only) and flip
one bit of a chosen field of chosen DATA frames: the type byte, the length,
the transfer id, seq, offset, raw or wire length, checksum, or the body.
:meth:`FaultProxy.reset` resets a connection now, whatever its program.
"""

from __future__ import annotations

import asyncio
import math
import random
import struct
from collections.abc import Awaitable, Callable, Collection
from dataclasses import dataclass, field

from kvbridge.errors import InvalidArgument

from .tcpproxy import Addr, TcpProxy, abort_with_rst

READ_SIZE = 64 * 1024
DIRECTIONS = ("c2s", "s2c")
_HEADER = struct.Struct("<IBBHI")  # magic, version, type, flags, length (protocol.md 2)
_DATA = 0x12
# [start, end) of each field in a DATA frame, counted from the frame's first byte
# (the 12-byte header, then the payload of protocol.md 5.3); "body" is the chunk body
FRAME_FIELDS: dict[str, tuple[int, int]] = {
    "type": (5, 6),
    "length": (8, 12),
    "id": (12, 20),
    "seq": (20, 28),
    "offset": (28, 36),
    "raw_length": (36, 40),
    "wire_length": (40, 44),
    "checksum": (48, 56),
    "body": (0, 0),
}


@dataclass
class Fault:
    """Base: which connections (0-based accept order; None = all) it hits."""

    conns: Collection[int] | int | None = field(default=None, kw_only=True)

    def applies(self, index: int) -> bool:
        if self.conns is None:
            return True
        if isinstance(self.conns, int):
            return index == self.conns
        return index in self.conns


def _check_direction(direction: str) -> None:
    if direction not in DIRECTIONS:
        raise InvalidArgument(f"direction must be one of {DIRECTIONS}, got {direction!r}")


@dataclass
class ResetAfter(Fault):
    """Forward ``nbytes`` of ``direction``, then reset both ends (TCP RST)."""

    nbytes: int
    direction: str = "c2s"

    def __post_init__(self) -> None:
        _check_direction(self.direction)
        if self.nbytes < 0:
            raise InvalidArgument(f"nbytes must be >= 0, got {self.nbytes}")


@dataclass
class Stall(Fault):
    """After ``after`` bytes of ``direction``, forward nothing more in that
    direction for ``seconds`` (None: until the connection ends)."""

    after: int = 0
    seconds: float | None = None
    direction: str = "c2s"

    def __post_init__(self) -> None:
        _check_direction(self.direction)
        if self.after < 0:
            raise InvalidArgument(f"after must be >= 0, got {self.after}")
        if self.seconds is not None and not self.seconds >= 0:
            raise InvalidArgument(f"seconds must be >= 0 or None, got {self.seconds}")


@dataclass
class FlipBits(Fault):
    """XOR ``mask`` into the byte at ``offset`` of ``direction``; or, with
    ``probability`` > 0, flip one random bit of each byte with that
    probability (reproducible with ``seed``)."""

    offset: int | None = None
    mask: int = 0x01
    probability: float = 0.0
    direction: str = "c2s"
    seed: int | None = None

    def __post_init__(self) -> None:
        _check_direction(self.direction)
        if (self.offset is None) == (self.probability == 0.0):
            raise InvalidArgument("FlipBits needs exactly one of offset and probability")
        if self.offset is not None and self.offset < 0:
            raise InvalidArgument(f"offset must be >= 0, got {self.offset}")
        if not 1 <= self.mask <= 0xFF:
            raise InvalidArgument(f"mask must be within [1, 255], got {self.mask}")
        if not 0.0 <= self.probability < 1.0:
            raise InvalidArgument(f"probability must be within [0, 1), got {self.probability}")


@dataclass
class DropAtAccept(Fault):
    """Reset the client's connection as soon as it is accepted, without
    connecting to the target."""


@dataclass
class HalfClose(Fault):
    """After ``after`` bytes of ``direction``, send FIN that way and forward
    nothing more in it; the other direction flows on."""

    after: int = 0
    direction: str = "c2s"

    def __post_init__(self) -> None:
        _check_direction(self.direction)
        if self.after < 0:
            raise InvalidArgument(f"after must be >= 0, got {self.after}")


@dataclass
class Blackhole(Fault):
    """After ``after`` bytes of ``direction``, forward nothing more in either
    direction and keep the connection open (a peer that went silent)."""

    after: int = 0
    direction: str = "c2s"

    def __post_init__(self) -> None:
        _check_direction(self.direction)
        if self.after < 0:
            raise InvalidArgument(f"after must be >= 0, got {self.after}")


@dataclass
class CorruptFrame(Fault):
    """Flip one bit of ``field`` (a key of :data:`FRAME_FIELDS`) in DATA frames
    from the client: the ``frames`` (0-based indices among the connection's
    DATA frames), or each DATA frame with ``probability`` (reproducible with
    ``seed``).  ``bit`` picks the bit within the field (None: a random one)."""

    field: str = "body"
    frames: Collection[int] | None = None
    probability: float = 0.0
    seed: int | None = None
    bit: int | None = None

    def __post_init__(self) -> None:
        if self.field not in FRAME_FIELDS:
            raise InvalidArgument(f"field must be one of {tuple(FRAME_FIELDS)}, got {self.field!r}")
        if (self.frames is None) == (self.probability == 0.0):
            raise InvalidArgument("CorruptFrame needs exactly one of frames and probability")
        if not 0.0 <= self.probability <= 1.0:
            raise InvalidArgument(f"probability must be within [0, 1], got {self.probability}")
        if self.bit is not None and self.bit < 0:
            raise InvalidArgument(f"bit must be >= 0, got {self.bit}")


@dataclass
class FaultStats:
    accepted: int = 0
    dropped_at_accept: int = 0
    connect_failures: int = 0
    resets: int = 0
    stalls: int = 0
    half_closes: int = 0
    blackholes: int = 0
    frames_corrupted: int = 0
    bits_flipped: int = 0
    bytes_c2s: int = 0
    bytes_s2c: int = 0
    # (connection index, kind, direction, byte offset)
    events: list[tuple[int, str, str, int]] = field(default_factory=list)


class _Flipper:
    """Where the next random flip falls, as a geometric gap over bytes."""

    def __init__(self, fault: FlipBits) -> None:
        self.p = fault.probability
        self.rng = random.Random(fault.seed)
        self.next = self._gap(0)

    def _gap(self, start: int) -> int:
        u = 1.0 - self.rng.random()  # (0, 1]
        return start + int(math.log(u) / math.log1p(-self.p))

    def take(self, end: int) -> list[tuple[int, int]]:
        """(offset, mask) of the flips before ``end``."""
        out = []
        while self.next < end:
            out.append((self.next, 1 << self.rng.randrange(8)))
            self.next = self._gap(self.next + 1)
        return out


async def flush(writer: asyncio.StreamWriter) -> None:
    """Wait until the transport has handed every written byte to the kernel."""
    writer.transport.set_write_buffer_limits(high=0)
    try:
        await writer.drain()
    finally:
        writer.transport.set_write_buffer_limits()  # back to the defaults


class FaultProxy(TcpProxy):
    """A TCP proxy that injects the faults in :attr:`faults` (see module doc)."""

    def __init__(
        self,
        target: Addr,
        faults: list[Fault] | None = None,
        listen: Addr = ("127.0.0.1", 0),
    ) -> None:
        super().__init__(target, listen)
        self.faults: list[Fault] = list(faults or [])
        self.stats = FaultStats()
        self._live: dict[int, tuple[asyncio.StreamWriter, asyncio.StreamWriter]] = {}

    @property
    def live_connections(self) -> list[int]:
        """Indices of the connections being proxied now."""
        return sorted(self._live)

    def reset(self, index: int | None = None) -> int:
        """Reset connection ``index`` now (None: every live one) with TCP RST
        at both ends; returns how many were reset."""
        hit = [i for i in self._live if index is None or i == index]
        for i in hit:
            c, srv = self._live.pop(i)
            self.stats.resets += 1
            self._event(i, "reset", "", 0)
            abort_with_rst(c)
            abort_with_rst(srv)
        return len(hit)

    def add(self, fault: Fault) -> FaultProxy:
        self.faults.append(fault)
        return self

    def set_faults(self, faults: list[Fault]) -> None:
        """Replace the program; connections already open keep theirs."""
        self.faults = list(faults)

    def _event(self, index: int, kind: str, direction: str, offset: int) -> None:
        self.stats.events.append((index, kind, direction, offset))

    async def on_accept(self, index: int, c_writer: asyncio.StreamWriter) -> bool:
        self.stats.accepted += 1
        if any(isinstance(f, DropAtAccept) and f.applies(index) for f in self.faults):
            self.stats.dropped_at_accept += 1
            self._event(index, "drop", "", 0)
            abort_with_rst(c_writer)
            return False
        return True

    def on_connect_failed(self, index: int, exc: BaseException) -> None:
        super().on_connect_failed(index, exc)
        self.stats.connect_failures += 1
        self._event(index, "connect_failed", "", 0)

    async def handle(
        self,
        index: int,
        c_reader: asyncio.StreamReader,
        c_writer: asyncio.StreamWriter,
        s_reader: asyncio.StreamReader,
        s_writer: asyncio.StreamWriter,
    ) -> None:
        active = [f for f in self.faults if f.applies(index)]
        reset = asyncio.Event()
        hole = asyncio.Event()  # a Blackhole fired: both directions stop
        self._live[index] = (c_writer, s_writer)
        tasks = [
            asyncio.ensure_future(
                self._pump(index, "c2s", c_reader, s_writer, active, reset, hole)
            ),
            asyncio.ensure_future(
                self._pump(index, "s2c", s_reader, c_writer, active, reset, hole)
            ),
        ]
        reset_wait = asyncio.ensure_future(reset.wait())
        try:
            while not reset.is_set():
                if any(t.done() and t.exception() is not None for t in tasks):
                    return  # a side failed: the caller aborts both
                if all(t.done() for t in tasks):
                    for w in (c_writer, s_writer):
                        w.close()
                        try:
                            await w.wait_closed()
                        except OSError:
                            pass
                    return
                await asyncio.wait(
                    [w for w in (*tasks, reset_wait) if not w.done()],
                    return_when=asyncio.FIRST_COMPLETED,
                )
            self.stats.resets += 1
            abort_with_rst(c_writer)
            abort_with_rst(s_writer)
        finally:
            self._live.pop(index, None)
            for t in [*tasks, reset_wait]:
                t.cancel()
            await asyncio.gather(*tasks, reset_wait, return_exceptions=True)

    async def _pump(
        self,
        index: int,
        direction: str,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        active: list[Fault],
        reset: asyncio.Event,
        hole: asyncio.Event,
    ) -> None:
        fixed_flips = sorted(
            (f.offset, f.mask)
            for f in active
            if isinstance(f, FlipBits) and f.direction == direction and f.offset is not None
        )
        flippers = [
            _Flipper(f)
            for f in active
            if isinstance(f, FlipBits) and f.direction == direction and f.probability > 0
        ]
        # cut points: (offset, kind, fault), handled in offset order
        kinds: list[tuple[type[Fault], str]] = [
            (ResetAfter, "reset"), (Stall, "stall"), (HalfClose, "halfclose"),
            (Blackhole, "blackhole"),
        ]  # fmt: skip
        cuts: list[tuple[int, str, Fault]] = sorted(
            (
                (f.nbytes if isinstance(f, ResetAfter) else getattr(f, "after", 0), kind, f)
                for f in active
                for cls, kind in kinds
                if isinstance(f, cls) and getattr(f, "direction", "c2s") == direction
            ),
            key=lambda c: c[0],
        )
        corrupt = [f for f in active if isinstance(f, CorruptFrame)] if direction == "c2s" else []
        read: Callable[[], Awaitable[bytes]] = (
            _FrameReader(self, index, reader, corrupt).next if corrupt else
            (lambda: reader.read(READ_SIZE))
        )  # fmt: skip
        pos = 0
        buf = b""
        counter = "bytes_c2s" if direction == "c2s" else "bytes_s2c"
        while True:
            while cuts and cuts[0][0] <= pos:
                _, kind, fault = cuts.pop(0)
                await flush(writer)
                if kind == "reset":
                    self._event(index, "reset", direction, pos)
                    reset.set()
                    return
                if kind == "halfclose":
                    self.stats.half_closes += 1
                    self._event(index, "halfclose", direction, pos)
                    if writer.can_write_eof():
                        writer.write_eof()
                    while await reader.read(READ_SIZE):  # read on, forward nothing
                        pass
                    return
                if kind == "blackhole":
                    self.stats.blackholes += 1
                    self._event(index, "blackhole", direction, pos)
                    hole.set()
                    await asyncio.Event().wait()  # until the connection is torn down
                assert isinstance(fault, Stall)
                self.stats.stalls += 1
                self._event(index, "stall", direction, pos)
                if fault.seconds is None:
                    await asyncio.Event().wait()  # until the connection is torn down
                else:
                    await asyncio.sleep(fault.seconds)
            if not buf:
                buf = await read()
                if not buf:
                    if writer.can_write_eof() and not hole.is_set():
                        writer.write_eof()
                    return
            limit = len(buf) if not cuts else min(len(buf), cuts[0][0] - pos)
            chunk, buf = buf[:limit], buf[limit:]
            end = pos + len(chunk)
            flips = [(o, m) for o, m in fixed_flips if pos <= o < end]
            for fl in flippers:
                flips.extend(fl.take(end))
            if flips:
                b = bytearray(chunk)
                for off, mask in flips:
                    b[off - pos] ^= mask
                    self.stats.bits_flipped += bin(mask).count("1")
                    self._event(index, "flip", direction, off)
                chunk = bytes(b)
            if hole.is_set():
                await asyncio.Event().wait()  # the other direction fell into a blackhole
            writer.write(chunk)
            await writer.drain()
            setattr(self.stats, counter, getattr(self.stats, counter) + len(chunk))
            pos = end


class _FrameReader:
    """Reads the client's bytes frame by frame and damages DATA frames as the
    connection's :class:`CorruptFrame` faults say.  A stream that is not
    kvbridge frames (a bad magic) is passed on as it is."""

    def __init__(
        self,
        proxy: FaultProxy,
        index: int,
        reader: asyncio.StreamReader,
        faults: list[CorruptFrame],
    ) -> None:
        self.proxy, self.index, self.reader, self.faults = proxy, index, reader, faults
        self.rngs = [random.Random(f.seed) for f in faults]
        self.data_frames = 0
        self.pos = 0
        self.raw = False

    async def next(self) -> bytes:
        if self.raw:
            return await self.reader.read(READ_SIZE)
        try:
            head = await self.reader.readexactly(_HEADER.size)
        except asyncio.IncompleteReadError as e:
            return e.partial
        magic, _v, ftype, _f, length = _HEADER.unpack(head)
        if magic != 0x4642564B:
            self.raw = True
            return head
        try:
            payload = await self.reader.readexactly(length)
        except asyncio.IncompleteReadError as e:
            return head + e.partial
        frame = bytearray(head + payload)
        if ftype == _DATA:
            self._corrupt(frame)
            self.data_frames += 1
        self.pos += len(frame)
        return bytes(frame)

    def _corrupt(self, frame: bytearray) -> None:
        n = self.data_frames
        for f, rng in zip(self.faults, self.rngs, strict=True):
            hit = n in f.frames if f.frames is not None else rng.random() < f.probability
            if not hit:
                continue
            a, b = FRAME_FIELDS[f.field]
            if f.field == "body":
                (wire,) = struct.unpack_from("<I", frame, 40) if len(frame) >= 44 else (0,)
                a, b = len(frame) - wire, len(frame)
            if b <= a or b > len(frame):
                continue
            nbits = (b - a) * 8
            bit = (f.bit if f.bit is not None else rng.randrange(nbits)) % nbits
            frame[a + bit // 8] ^= 1 << (bit % 8)
            self.proxy.stats.frames_corrupted += 1
            self.proxy.stats.bits_flipped += 1
            self.proxy._event(self.index, f"corrupt:{f.field}", "c2s", self.pos + a + bit // 8)
