"""The engine registry: who is in the fleet (docs/fleet.md).

``records`` and ``view`` are sans-IO (the record codec, the local view and the
resolver a bridge asks); ``etcd`` is the edge on a real etcd v3 server.
"""

from kvbridge.registry.records import (
    DEFAULT_PREFIX,
    RECORD_VERSION,
    BadRecord,
    EngineRecord,
    LoadReport,
    Role,
    decode_record,
    encode_record,
    engine_key,
    engines_prefix,
    new_generation,
    parse_hostport,
)
from kvbridge.registry.view import (
    PeerAddress,
    RegistryView,
    Resolver,
    StaticResolver,
    UnknownPeer,
    ViewChange,
)

__all__ = [
    "DEFAULT_PREFIX",
    "RECORD_VERSION",
    "BadRecord",
    "EngineRecord",
    "LoadReport",
    "PeerAddress",
    "RegistryView",
    "Resolver",
    "Role",
    "StaticResolver",
    "UnknownPeer",
    "ViewChange",
    "decode_record",
    "encode_record",
    "engine_key",
    "engines_prefix",
    "new_generation",
    "parse_hostport",
]
