"""atheris fuzz target for the frame codec and the handshake parsers.

    make fuzz                      (installs atheris if missing, runs 60 s)
    python tests/fuzz/fuzz_codec.py -max_total_time=60

Any exception other than a kvbridge error is a bug, and so is any difference
between decoding a stream with and without ``place`` (the receiver's path
that lands large DATA payloads straight in the destination): the fuzzer's
bytes either are the stream, or describe one with large DATA frames (their
bodies made from a seed, since libFuzzer's inputs stay small) that it then
damages at one byte and cuts into reads.
"""

from __future__ import annotations

import random
import sys

import atheris

from kvbridge.errors import KVBridgeError
from kvbridge.wire import FrameDecoder, ServerHandshake, encode_frame
from kvbridge.wire.chunk import checksum, decode_chunk
from kvbridge.wire.frames import Data, DataHead, Hello, Ping


def decode(stream: bytes, cuts: list[int], place: bool) -> tuple[list[object], str]:
    def lend(head: DataHead) -> memoryview:
        return memoryview(bytearray(head.wire_length))

    dec = FrameDecoder(max_payload=1 << 20, place=lend if place else None)
    out: list[object] = []
    prev = 0
    try:
        for c in [*cuts, len(stream)]:
            for m in dec.feed(stream[prev:c]):
                if isinstance(m, Hello):
                    ServerHandshake("fuzz", 0, psk=b"k").on_hello(m)
                elif isinstance(m, Data):
                    if m.digest is not None and m.digest != checksum(m.data):
                        raise AssertionError("digest differs from the bytes delivered")
                    decode_chunk(m.data, m.raw_length % (1 << 20), m.codec, m.shuffle, m.checksum)
                    m = (m.transfer_id, m.seq, m.offset, m.raw_length, m.codec, m.shuffle,
                         m.checksum, bytes(m.data))  # fmt: skip
                out.append(m)
            prev = c
    except KVBridgeError as e:
        return out, type(e).__name__
    return out, ""


def one_input(blob: bytes) -> None:
    fdp = atheris.FuzzedDataProvider(blob)
    if fdp.ConsumeBool():  # the bytes are the stream
        split = fdp.ConsumeIntInRange(1, 64)
        stream = fdp.ConsumeBytes(fdp.remaining_bytes())
        cuts = list(range(split, len(stream), split))
    else:  # the bytes describe a stream with large DATA frames
        parts = []
        for _ in range(fdp.ConsumeIntInRange(1, 4)):
            if fdp.ConsumeBool():
                n = fdp.ConsumeIntInRange(1, 400_000)
                body = random.Random(n).randbytes(n)
                tid = fdp.ConsumeIntInRange(0, 2**64 - 1)
                parts.append(encode_frame(Data(tid, 0, 0, n, 0, 0, checksum(body), body)))
            else:
                parts.append(encode_frame(Ping(fdp.ConsumeIntInRange(0, 2**64 - 1))))
        stream = bytearray(b"".join(parts))
        if fdp.ConsumeBool():
            stream[fdp.ConsumeIntInRange(0, len(stream) - 1)] ^= fdp.ConsumeIntInRange(1, 255)
        stream = bytes(stream)
        cuts = sorted(
            fdp.ConsumeIntInRange(0, len(stream)) for _ in range(fdp.ConsumeIntInRange(0, 6))
        )
    if decode(stream, cuts, place=False) != decode(stream, cuts, place=True):
        raise AssertionError("placing changed what was decoded")


def main() -> None:
    # instrument_imports() sees no coverage through the editable install's
    # custom module loader (libFuzzer then reports a corpus of 1 input)
    atheris.instrument_all()
    atheris.Setup(sys.argv, one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
