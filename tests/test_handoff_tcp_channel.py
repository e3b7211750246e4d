"""The handoff's RoutedChannel over kvbridge's real TCP connections: relay and
main decode exchange handoff messages as CONTROL frames both ways, the client
route is a callback, and an unknown destination is a typed error."""

from __future__ import annotations

import pytest
from tcp_support import arun

from kvbridge.errors import PeerGone
from kvbridge.handoff import Ack, SamplingParams, Tokens, decode, encode
from kvbridge.handoff.channel import RoutedChannel
from kvbridge.transport.tcp import TcpReceiver, TcpSender


def test_relay_and_main_talk_over_control_frames() -> None:
    async def main() -> None:
        rx = await TcpReceiver(identity="main-decode").start()
        tx = TcpSender("127.0.0.1", rx.port, identity="relay")
        await tx.connect()
        md, rld = RoutedChannel("md"), RoutedChannel("rld")
        md.link_receiver("rld", rx, "relay")
        rld.link_sender("md", tx)
        to_client: list[tuple[int, bytes]] = []
        rld.route("client", lambda ft, p: to_client.append((ft, p)))

        tokens = Tokens(7, 1, (11, 12, 13), SamplingParams(0.0), commit=True)
        await rld.send("md", int(tokens.KIND), encode(tokens))
        got = await md.recv(5)
        assert (
            got is not None and got.src == "rld" and decode(got.payload, got.frame_type) == tokens
        )

        ack = Ack(7, 4, switched=True, switch_at=4)
        await md.send("rld", int(ack.KIND), encode(ack))
        back = await rld.recv(5)
        assert back is not None and back.src == "md" and decode(back.payload) == ack

        await rld.send("client", 0x44, b"x")
        assert to_client == [(0x44, b"x")]
        with pytest.raises(PeerGone):
            await md.send("nobody", 0x40, b"")
        assert await md.recv(0.05) is None  # nothing else arrived
        await tx.close()
        await rx.close()

    arun(main())
