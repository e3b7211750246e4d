"""Adaptive chunk compression: on only when it makes the transfer faster.

Compressing pays when the link, not the CPU, is the bottleneck:
with a link of ``L`` bytes/s, a ratio ``r`` (wire / raw bytes) and spare cores
compressing ``s`` bytes/s each, goodput is ``L`` raw and
``min(L / r, cores * s)`` compressed.  ``auto`` trial-compresses the first
chunk of a transfer (byte shuffle for 2-byte dtypes, then zstd level 1 and
lz4), measures ``r`` and ``s``, and turns compression on only when the
compressed goodput beats ``L`` by ``margin``.  When ``L`` already exceeds what
the spare cores could compress at the best measured speed ever seen, no trial
is run.  Every decision is recorded with its numbers.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

from ...errors import InvalidArgument
from ...wire.chunk import encode_chunk
from ...wire.frames import ChunkCodec

__all__ = ["CompressionDecision", "CompressionPolicy"]

MODES = ("auto", "off", "lz4", "zstd")
_CODEC_NAMES = {int(c): c.name.lower() for c in ChunkCodec}
_ZSTD_BEST_BPS = 0.6e9  # optimistic zstd-1 speed per core before any measurement


@dataclass
class CompressionDecision:
    codec: int = ChunkCodec.RAW
    shuffle: int = 0
    reason: str = "off"
    ratio_zstd: float | None = None
    ratio_lz4: float | None = None
    compress_Bps: float | None = None
    link_Bps: float | None = None

    def as_dict(self) -> dict[str, object]:
        d: dict[str, object] = dict(self.__dict__)  # flat fields: no deep copy (asdict is slow)
        d["codec"] = _CODEC_NAMES.get(self.codec) or ChunkCodec(self.codec).name.lower()
        return d


class CompressionPolicy:
    def __init__(
        self,
        mode: str = "auto",
        *,
        link_Bps: float | None = None,
        spare_cores: int | None = None,
        margin: float = 1.1,
        min_bytes: int = 8 << 20,
    ) -> None:
        if mode not in MODES:
            raise InvalidArgument(f"compression must be one of {MODES}, not {mode!r}")
        self.mode = mode
        self.link_Bps = link_Bps
        self.spare_cores = spare_cores or max(1, (os.cpu_count() or 2) - 1)
        self.margin = margin
        self.min_bytes = min_bytes
        self.measured_link_Bps: float | None = None
        self.best_compress_Bps = _ZSTD_BEST_BPS

    def observe_goodput(self, nbytes: int, seconds: float) -> None:
        """Feed the goodput of a finished transfer (the link estimate when
        no ``link_Bps`` was configured)."""
        if nbytes >= self.min_bytes and seconds > 0:
            g = nbytes / seconds
            m = self.measured_link_Bps
            self.measured_link_Bps = g if m is None else 0.7 * m + 0.3 * g

    def without_trial(
        self, itemsize: int, total_bytes: int, mode: str | None = None
    ) -> CompressionDecision | None:
        """The decision when it needs no trial of the data (configured, a
        small transfer, an unknown or too fast link); None when it does."""
        mode = mode or self.mode
        shuffle = 2 if itemsize == 2 else 0
        if mode == "off":
            return CompressionDecision(reason="off by configuration")
        if mode in ("lz4", "zstd"):
            codec = ChunkCodec.LZ4 if mode == "lz4" else ChunkCodec.ZSTD
            return CompressionDecision(codec, shuffle, f"{mode} by configuration")
        link = self.link_Bps or self.measured_link_Bps
        d = CompressionDecision(link_Bps=link)
        if total_bytes < self.min_bytes:
            d.reason = "transfer too small to pay for a trial"
            return d
        if link is None:
            d.reason = "link rate unknown (measured after the first transfer)"
            return d
        if link > self.spare_cores * self.best_compress_Bps:
            d.reason = "link faster than the spare cores can compress"
            return d
        return None

    def decide(
        self, sample: memoryview, itemsize: int, total_bytes: int, mode: str | None = None
    ) -> CompressionDecision:
        d0 = self.without_trial(itemsize, total_bytes, mode)
        if d0 is not None:
            return d0
        shuffle = 2 if itemsize == 2 else 0
        link = self.link_Bps or self.measured_link_Bps
        assert link is not None
        d = CompressionDecision(link_Bps=link)
        t0 = time.perf_counter()
        wz, _ = encode_chunk(sample, ChunkCodec.ZSTD, shuffle)
        tz = time.perf_counter() - t0
        t0 = time.perf_counter()
        wl, _ = encode_chunk(sample, ChunkCodec.LZ4, shuffle)
        tl = time.perf_counter() - t0
        n = max(1, len(sample))
        d.ratio_zstd, d.ratio_lz4 = len(wz) / n, len(wl) / n
        best = None
        for codec, ratio, secs in (
            (ChunkCodec.ZSTD, d.ratio_zstd, tz),
            (ChunkCodec.LZ4, d.ratio_lz4, tl),
        ):
            speed = n / max(secs, 1e-9)
            if ratio < 0.95:  # only a speed that comes with a gain may skip future trials
                self.best_compress_Bps = max(self.best_compress_Bps, speed)
            goodput = min(link / max(ratio, 1e-6), self.spare_cores * speed)
            if best is None or goodput > best[0]:
                best = (goodput, codec, speed)
        assert best is not None
        goodput, codec, speed = best
        d.compress_Bps = speed
        if goodput >= self.margin * link:
            d.codec, d.shuffle = codec, shuffle
            d.reason = f"pays: {goodput / link:.2f}x the raw goodput"
        else:
            d.reason = f"does not pay: {goodput / link:.2f}x the raw goodput"
        return d
