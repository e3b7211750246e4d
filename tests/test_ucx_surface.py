"""The UCX transport's public surface is what an engine calls (docs/ucx.md,
"API"): it cannot grow silently.  A new public attribute of UcxAgent,
UcxPeer or PreparedSend fails here until the page and this set name it."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import pytest
from ucx_cases import SMALL, make_cache
from ucx_cases import agent as ucx_agent

from kvbridge.transport import ucx

pytestmark = [
    pytest.mark.ucx,
    pytest.mark.skipif(not ucx.available(), reason=f"UCX unavailable: {ucx.unavailable_reason()}"),
]

AGENT = {
    "agent_id", "identity", "layout",  # who it is
    "metadata", "connect", "peers", "peer", "on_peer",  # peers
    "expect",  # receiving (sending is the peer's)
    "start", "stats", "close",
}  # fmt: skip
PEER = {
    "agent_id", "identity", "authenticated", "name", "layout", "same_layout", "error",
    "send", "prepare_send", "expect", "abort", "close",
}  # fmt: skip
PREPARED = {"post", "peer", "start", "end", "layers", "nbytes", "runs"}


def public(obj: object) -> set[str]:
    return {n for n in dir(obj) if not n.startswith("_")}


def test_the_public_surface_is_the_engine_facing_verbs() -> None:
    async def body() -> None:
        a = ucx_agent(SMALL, make_cache(SMALL, 8, 1))
        b = ucx_agent(SMALL, make_cache(SMALL, 8, None))
        peer = await a.connect(b.metadata())
        prepared = peer.prepare_send([0], [0], 0, SMALL.page_tokens)
        assert public(a) == AGENT
        assert public(peer) == PEER
        assert public(prepared) == PREPARED
        assert public(ucx.UcxAgent) <= AGENT and public(ucx.UcxPeer) <= PEER
        await a.close()
        await b.close()

    asyncio.run(asyncio.wait_for(body(), 30))


def test_the_api_section_names_exactly_that_surface() -> None:
    doc = (Path(__file__).resolve().parent.parent / "docs" / "ucx.md").read_text()
    api = doc[doc.index("\n## API") : doc.index("\n## The put path")]
    for kind, names in (("UcxAgent", AGENT), ("UcxPeer", PEER), ("PreparedSend", PREPARED)):
        m = re.search(rf"<!-- surface {kind}: ([^>]*) -->", api)
        assert m, f"docs/ucx.md's API section lost its {kind} surface line"
        assert set(m.group(1).split()) == names, kind
