"""Registry records, sans-IO: what an engine writes under its lease, byte for byte.

Key: ``<prefix>/engines/<engine_id>`` (UTF-8; ``prefix`` defaults to
``/kvbridge/v1``).  Value: one UTF-8 JSON object (docs/fleet.md)::

    {"v": 1, "engine_id": "p-0", "role": "prefill", "datacenter": "dc-a",
     "model": "llama-3-8b", "compat_hash": "00ab...16 hex digits",
     "generation": "hex string, new at every start",
     "endpoints": {"tcp": "host:port", "ucx": "host:port or absent"},
     "load": {"free_blocks": 0, "queued_tokens": 0, "active_transfers": 0},
     "prefixes": ["32 hex digits", ...]}

A record of another version, or one that does not parse, is reported as
:class:`BadRecord` (a value, never an exception past :func:`decode_record`'s
callers in the view).
"""

from __future__ import annotations

import enum
import json
import os
import re
from dataclasses import dataclass, field
from typing import Any

from kvbridge.errors import InvalidArgument

__all__ = [
    "DEFAULT_PREFIX",
    "RECORD_VERSION",
    "BadRecord",
    "EngineRecord",
    "LoadReport",
    "Role",
    "decode_record",
    "encode_record",
    "engine_key",
    "engines_prefix",
    "new_generation",
    "parse_hostport",
]

RECORD_VERSION = 1
DEFAULT_PREFIX = "/kvbridge/v1"
_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")
_HEX16 = re.compile(r"^[0-9a-f]{16}$")
_HEX32 = re.compile(r"^[0-9a-f]{32}$")
MAX_PREFIXES = 4096


class Role(str, enum.Enum):
    PREFILL = "prefill"
    RELAY = "relay"
    MAIN = "main"
    BOTH = "both"  # relay and main decode

    def serves(self, role: Role) -> bool:
        return self is role or (self is Role.BOTH and role in (Role.RELAY, Role.MAIN))


@dataclass(frozen=True)
class LoadReport:
    free_blocks: int = 0
    queued_tokens: int = 0
    active_transfers: int = 0

    def as_dict(self) -> dict[str, int]:
        return {
            "free_blocks": self.free_blocks,
            "queued_tokens": self.queued_tokens,
            "active_transfers": self.active_transfers,
        }


@dataclass(frozen=True)
class EngineRecord:
    engine_id: str
    role: Role
    datacenter: str
    model: str
    compat_hash: int  # kvbridge.layout.KVLayout.compat_hash
    generation: str
    endpoints: dict[str, str]
    load: LoadReport = field(default_factory=LoadReport)
    # page hashes (kvbridge.cache.hashing) the engine still holds, most recent first
    prefixes: tuple[bytes, ...] = ()

    def __post_init__(self) -> None:
        if not _ID.match(self.engine_id):
            raise InvalidArgument(f"engine_id {self.engine_id!r}: 1-128 of [A-Za-z0-9._:-]")
        if not 0 <= self.compat_hash < 2**64:
            raise InvalidArgument("compat_hash must be a 64-bit unsigned integer")
        if not self.generation or not _ID.match(self.generation):
            raise InvalidArgument("generation must be a non-empty token")
        if "tcp" in self.endpoints:
            parse_hostport(self.endpoints["tcp"])
        if len(self.prefixes) > MAX_PREFIXES or any(len(p) != 16 for p in self.prefixes):
            raise InvalidArgument(f"at most {MAX_PREFIXES} prefixes of 16 bytes each")

    @property
    def tcp(self) -> tuple[str, int] | None:
        ep = self.endpoints.get("tcp")
        return parse_hostport(ep) if ep else None


@dataclass(frozen=True)
class BadRecord:
    key: str
    reason: str


def new_generation() -> str:
    """A fresh generation: 16 random hex digits (a new one at every start)."""
    return os.urandom(8).hex()


def engines_prefix(prefix: str = DEFAULT_PREFIX) -> str:
    return prefix.rstrip("/") + "/engines/"


def engine_key(engine_id: str, prefix: str = DEFAULT_PREFIX) -> str:
    if not _ID.match(engine_id):
        raise InvalidArgument(f"engine_id {engine_id!r}: 1-128 of [A-Za-z0-9._:-]")
    return engines_prefix(prefix) + engine_id


def parse_hostport(s: str) -> tuple[str, int]:
    host, sep, port = s.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise InvalidArgument(f"endpoint {s!r} is not host:port")
    return host.strip("[]"), int(port)


def encode_record(rec: EngineRecord) -> bytes:
    doc: dict[str, Any] = {
        "v": RECORD_VERSION,
        "engine_id": rec.engine_id,
        "role": rec.role.value,
        "datacenter": rec.datacenter,
        "model": rec.model,
        "compat_hash": f"{rec.compat_hash:016x}",
        "generation": rec.generation,
        "endpoints": dict(rec.endpoints),
        "load": rec.load.as_dict(),
        "prefixes": [p.hex() for p in rec.prefixes],
    }
    return json.dumps(doc, separators=(",", ":"), sort_keys=True).encode()


def _int(d: dict[str, Any], name: str) -> int:
    v = d.get(name, 0)
    if not isinstance(v, int) or isinstance(v, bool) or v < 0:
        raise InvalidArgument(f"load.{name} must be an integer >= 0")
    return v


def _str(d: dict[str, Any], name: str) -> str:
    v = d.get(name)
    if not isinstance(v, str):
        raise InvalidArgument(f"{name} must be a string")
    return v


def decode_record(key: str, value: bytes, prefix: str = DEFAULT_PREFIX) -> EngineRecord | BadRecord:
    """Decode one registry value; anything wrong is a :class:`BadRecord`."""
    try:
        doc = json.loads(value.decode("utf-8"))
        if not isinstance(doc, dict):
            raise InvalidArgument("value is not a JSON object")
        if doc.get("v") != RECORD_VERSION:
            return BadRecord(key, f"unknown record version {doc.get('v')!r}")
        engine_id = _str(doc, "engine_id")
        if key != engine_key(engine_id, prefix):
            raise InvalidArgument(f"key does not name engine {engine_id!r}")
        ch = _str(doc, "compat_hash")
        if not _HEX16.match(ch):
            raise InvalidArgument("compat_hash must be 16 lowercase hex digits")
        eps = doc.get("endpoints")
        if not isinstance(eps, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in eps.items()
        ):
            raise InvalidArgument("endpoints must map names to strings")
        load = doc.get("load", {})
        if not isinstance(load, dict):
            raise InvalidArgument("load must be an object")
        prefixes = doc.get("prefixes", [])
        if not isinstance(prefixes, list) or not all(
            isinstance(p, str) and _HEX32.match(p) for p in prefixes
        ):
            raise InvalidArgument("prefixes must be a list of 32-hex-digit strings")
        return EngineRecord(
            engine_id=engine_id,
            role=Role(_str(doc, "role")),
            datacenter=_str(doc, "datacenter"),
            model=_str(doc, "model"),
            compat_hash=int(ch, 16),
            generation=_str(doc, "generation"),
            endpoints=dict(eps),
            load=LoadReport(
                _int(load, "free_blocks"),
                _int(load, "queued_tokens"),
                _int(load, "active_transfers"),
            ),
            prefixes=tuple(bytes.fromhex(p) for p in prefixes),
        )
    except (ValueError, UnicodeDecodeError) as e:  # json, enum and InvalidArgument errors
        return BadRecord(key, f"malformed record: {e}")
