"""The bridges' constructors take one set of options: each option any of
PrefillBridge, DecodeBridge and SyncBridge accepts is a BridgeOptions field
with the same default, and SyncBridge accepts every option of both."""

from __future__ import annotations

import dataclasses
import inspect

import pytest

import kvbridge
from kvbridge.bridge import BridgeOptions, DecodeBridge, PrefillBridge, SyncBridge
from kvbridge.errors import InvalidArgument

# parameters that are not options: the cache, and SyncBridge's bound on its
# blocking calls (the async bridges have no blocking calls)
_NOT_OPTIONS = {"self", "cache", "call_timeout"}


def _options(cls: type) -> dict[str, object]:
    params = inspect.signature(cls.__init__).parameters
    return {n: p.default for n, p in params.items() if n not in _NOT_OPTIONS}


@pytest.mark.parametrize("cls", [PrefillBridge, DecodeBridge, SyncBridge])
def test_every_constructor_option_is_a_shared_option_with_its_default(cls: type) -> None:
    shared = {f.name: f.default for f in dataclasses.fields(BridgeOptions)}
    for name, default in _options(cls).items():
        assert name in shared, f"{cls.__name__} takes {name!r}, which BridgeOptions lacks"
        if name == "identity":  # each bridge names itself
            continue
        assert default == shared[name], (cls.__name__, name, default, shared[name])
    params = inspect.signature(cls.__init__).parameters
    assert all(
        p.kind is inspect.Parameter.KEYWORD_ONLY
        for n, p in params.items()
        if n not in ("self", "cache")
    )


def test_sync_bridge_takes_every_option_of_both_async_bridges() -> None:
    sync = set(_options(SyncBridge))
    missing = (set(_options(PrefillBridge)) | set(_options(DecodeBridge))) - sync
    assert not missing, f"SyncBridge lacks {sorted(missing)}"
    assert "tls_identity" in sync


def test_options_reach_the_async_bridges_by_name() -> None:
    opts = BridgeOptions(identity="p", tls_identity="san", lease_timeout=7.0, tcp_listen=None)
    pk = opts.kwargs_for(PrefillBridge, metrics="m")
    assert set(pk) == set(_options(PrefillBridge))
    assert pk["lease_timeout"] == 7.0 and pk["metrics"] == "m" and pk["identity"] == "p"
    dk = opts.kwargs_for(DecodeBridge)
    assert set(dk) == set(_options(DecodeBridge)) and dk["tls_identity"] == "san"
    with pytest.raises(dataclasses.FrozenInstanceError):
        opts.identity = "q"  # type: ignore[misc]


def test_sync_bridge_refuses_its_own_agent_and_a_given_one() -> None:
    pytest.importorskip("kvbridge._core")
    from kvbridge.layout import KVLayout
    from kvbridge.pack import PagedKVCache

    layout = KVLayout(num_layers=1, num_kv_heads=1, head_dim=8, dtype="bf16", page_tokens=16)
    cache = PagedKVCache.allocate(layout, 4)
    with pytest.raises(InvalidArgument):
        SyncBridge(cache, ucx=True, ucx_agent=object())


def test_top_level_exports_the_cache_and_the_options() -> None:
    from kvbridge.pack import PagedKVCache

    assert kvbridge.PagedKVCache is PagedKVCache
    assert kvbridge.BridgeOptions is BridgeOptions
    assert {"PagedKVCache", "BridgeOptions"} <= set(kvbridge.__all__)
