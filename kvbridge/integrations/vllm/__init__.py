"""kvbridge inside vLLM: a KV connector, a disaggregation proxy, model preparation.

``KVBridgeConnector`` (vLLM's ``kv_connector="KVBridgeConnector"`` with
``kv_connector_module_path="kvbridge.integrations.vllm"``) is imported on
first use, so that the proxy and the parameter helpers work without vLLM.
docs/vllm.md is the operator's guide.
"""

from __future__ import annotations

from typing import Any

__all__ = ["KVBridgeConnector"]


def __getattr__(name: str) -> Any:
    if name == "KVBridgeConnector":
        from .connector import KVBridgeConnector

        return KVBridgeConnector
    raise AttributeError(name)
