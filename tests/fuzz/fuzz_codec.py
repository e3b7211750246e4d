"""atheris fuzz target for the frame codec and the handshake parsers.

    make fuzz                      (installs atheris if missing, runs 60 s)
    python tests/fuzz/fuzz_codec.py -max_total_time=60

Any exception other than a kvbridge error is a bug.
"""

from __future__ import annotations

import sys

import atheris

with atheris.instrument_imports():
    from kvbridge.errors import KVBridgeError
    from kvbridge.wire import FrameDecoder, ServerHandshake
    from kvbridge.wire.chunk import decode_chunk
    from kvbridge.wire.frames import Data, Hello


def one_input(blob: bytes) -> None:
    fdp = atheris.FuzzedDataProvider(blob)
    split = fdp.ConsumeIntInRange(1, 64)
    data = fdp.ConsumeBytes(fdp.remaining_bytes())
    dec = FrameDecoder(max_payload=1 << 16)
    try:
        for i in range(0, len(data), split):
            for m in dec.feed(data[i : i + split]):
                if isinstance(m, Hello):
                    ServerHandshake("fuzz", 0, psk=b"k").on_hello(m)
                elif isinstance(m, Data):
                    decode_chunk(m.data, m.raw_length % (1 << 20), m.codec, m.shuffle, m.checksum)
    except KVBridgeError:
        pass


def main() -> None:
    atheris.Setup(sys.argv, one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
