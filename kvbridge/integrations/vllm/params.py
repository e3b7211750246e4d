"""The ``kv_transfer_params`` of kvbridge's vLLM connector (docs/vllm.md).

vLLM carries a free-form dict per request (``kv_transfer_params`` in the
OpenAI request body, ``SamplingParams.extra_args["kv_transfer_params"]``
offline) from the client to the connector, and one back in the final output.
This module parses and builds those dicts; nothing here imports vLLM.

A request for the **prefill** (``kv_role`` producer)::

    {"do_remote_decode": true,
     "transfer_id": "9f3c...",          # names the transfer at both ends
     "destinations": ["md"],            # or ["rld", "md"]: decode identities
     "await_tickets_s": 2.0}            # optional: wait (at most this) for every
                                        # destination's ticket before the prefill runs,
                                        # so that each layer leaves as it is computed

A request for a **decode** (``kv_role`` consumer)::

    {"do_remote_prefill": true,
     "transfer_id": "9f3c...",          # the same id the prefill was given
     "prefill": "prefill-0",            # the prefill's kvbridge identity
     "prefill_tp": 2,                   # optional: its tensor-parallel ranks (default 1);
                                        # each decode rank sends a ticket to every prefill
                                        # rank that holds some of its KV heads
     "pin_s": 30.0}                     # optional: hold the blocks after the request

A decode request that takes over a pinned transfer (the PDD handoff)::

    {"unpin": "9f3c..."}                # release the pin once this request holds the blocks

The prefill's output params are exactly what a decode request needs
(``do_remote_prefill``, ``transfer_id``, ``prefill``) plus ``num_tokens`` and
``destinations``, so a proxy that runs the prefill first passes them on as
they are.  A decode's output params report the transfer (``kv``: tokens
found in its own prefix cache, tokens loaded, bytes, path, seconds, or
``error``).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

from ...errors import InvalidArgument

__all__ = [
    "MAX_AWAIT_S",
    "MAX_PIN_S",
    "DecodeParams",
    "PrefillParams",
    "UnpinParams",
    "decode_output",
    "parse_params",
    "prefill_output",
]

# a transfer id is also the request id of the kvbridge transfer (docs/protocol.md: <= 1024 B)
_ID = re.compile(r"[A-Za-z0-9._:/-]{1,128}")
MAX_PIN_S = 600.0
MAX_AWAIT_S = 60.0
MAX_TP = 64


def _seconds(d: dict[str, Any], key: str, top: float) -> float:
    v = d.get(key, 0.0)
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise InvalidArgument(f"kv_transfer_params[{key!r}] must be a number, got {v!r}")
    if not (math.isfinite(v) and 0 <= v <= top):
        raise InvalidArgument(f"kv_transfer_params[{key!r}] must be in [0, {top}], got {v!r}")
    return float(v)


def _ident(d: dict[str, Any], key: str) -> str:
    v = d.get(key)
    if not isinstance(v, str) or not _ID.fullmatch(v):
        raise InvalidArgument(
            f"kv_transfer_params[{key!r}] must be 1-128 characters of [A-Za-z0-9._:/-], got {v!r}"
        )
    return v


@dataclass(frozen=True)
class PrefillParams:
    """A request whose prompt KV this prefill sends to ``destinations``."""

    transfer_id: str
    destinations: tuple[str, ...]
    await_tickets_s: float = 0.0


@dataclass(frozen=True)
class DecodeParams:
    """A request whose prompt KV arrives from the prefill ``prefill``."""

    transfer_id: str
    prefill: str
    pin_s: float = 0.0
    prefill_tp: int = 1


@dataclass(frozen=True)
class UnpinParams:
    """A request that takes over the blocks pinned by transfer ``transfer_id``."""

    transfer_id: str


Params = PrefillParams | DecodeParams | UnpinParams


def parse_params(params: Any) -> Params | None:
    """The connector's view of one request's ``kv_transfer_params``.

    ``None`` (or a dict with none of our keys) is a plain local request.
    A dict that names a kvbridge role but is malformed raises
    :class:`~kvbridge.errors.InvalidArgument` saying which field is wrong.
    """
    if params is None:
        return None
    if not isinstance(params, dict):
        raise InvalidArgument(f"kv_transfer_params must be a dict, got {type(params).__name__}")
    dec, pre = bool(params.get("do_remote_decode")), bool(params.get("do_remote_prefill"))
    if dec and pre:
        raise InvalidArgument("kv_transfer_params: do_remote_decode and do_remote_prefill both set")
    if dec:
        tid = _ident(params, "transfer_id")
        dests = params.get("destinations")
        if not isinstance(dests, list | tuple) or not dests:
            raise InvalidArgument("kv_transfer_params['destinations'] must be a non-empty list")
        names = tuple(_ident({"d": d}, "d") for d in dests)
        if len(set(names)) != len(names):
            raise InvalidArgument(f"kv_transfer_params['destinations'] repeats a name: {names}")
        return PrefillParams(tid, names, _seconds(params, "await_tickets_s", MAX_AWAIT_S))
    if pre:
        tid = _ident(params, "transfer_id")
        prefill = _ident(params, "prefill")
        tp = params.get("prefill_tp", 1)
        if isinstance(tp, bool) or not isinstance(tp, int) or not 1 <= tp <= MAX_TP:
            raise InvalidArgument(
                f"kv_transfer_params['prefill_tp'] must be an int in [1, {MAX_TP}], got {tp!r}"
            )
        return DecodeParams(tid, prefill, _seconds(params, "pin_s", MAX_PIN_S), tp)
    if "unpin" in params:
        return UnpinParams(_ident(params, "unpin"))
    return None


def prefill_output(
    p: PrefillParams, prefill: str, num_tokens: int, prefill_tp: int = 1
) -> dict[str, Any]:
    """The prefill's output params: a decode request's params, ready to pass on."""
    out: dict[str, Any] = {
        "do_remote_prefill": True,
        "transfer_id": p.transfer_id,
        "prefill": prefill,
        "num_tokens": num_tokens,
        "destinations": list(p.destinations),
    }
    if prefill_tp > 1:
        out["prefill_tp"] = prefill_tp
    return out


def decode_output(p: DecodeParams, kv: dict[str, Any], *, pinned: bool) -> dict[str, Any]:
    """A decode's output params: what the transfer did."""
    return {"transfer_id": p.transfer_id, "prefill": p.prefill, "kv": kv, "pinned": pinned}
