"""Type stubs of the nanobind module kvbridge._core (bindings/)."""

from collections.abc import Sequence
from typing import Any

BUILT_WITH_CUDA: bool
ABI_VERSION: int

class CacheDesc:
    def __init__(
        self,
        layer_ptrs: list[int],
        num_components: int,
        num_heads: int,
        head_bytes: int,
        page_tokens: int,
        num_pages: int,
        stride_component: int,
        stride_page: int,
        stride_token: int,
        stride_head: int,
        device: int,
        elem_bytes: int = 0,
        component_strides: list[int] = ...,
        component_ptrs: list[int] = ...,
    ) -> None: ...
    def open(self) -> tuple[int, str]: ...

class Plan:
    @property
    def nbytes(self) -> int: ...

def make_plan(
    desc: CacheDesc,
    block_table: Any,
    token_start: int,
    token_end: int,
    layer_start: int,
    layer_end: int,
    head_start: int,
    head_end: int,
    writable: bool,
) -> tuple[int, str, Plan | None]: ...
def plan_pack(
    plan: Plan,
    wire_offset: int,
    out: Any,
    nbytes: int,
    num_threads: int,
    stream: int,
    checksum: bool,
) -> tuple[int, str, int]: ...
def plan_unpack(
    plan: Plan,
    wire_offset: int,
    src: Any,
    nbytes: int,
    num_threads: int,
    stream: int,
    expect: int | None,
) -> tuple[int, str]: ...
def pack(
    desc: CacheDesc,
    block_table: Any,
    token_start: int,
    token_end: int,
    layer_start: int,
    layer_end: int,
    wire_offset: int,
    out: Any,
    nbytes: int,
    num_threads: int,
    stream: int,
    head_start: int = 0,
    head_end: int = 0,
) -> tuple[int, str]: ...
def unpack(
    desc: CacheDesc,
    block_table: Any,
    token_start: int,
    token_end: int,
    layer_start: int,
    layer_end: int,
    wire_offset: int,
    src: Any,
    nbytes: int,
    num_threads: int,
    stream: int,
    head_start: int = 0,
    head_end: int = 0,
) -> tuple[int, str]: ...
def validate(
    desc: CacheDesc,
    block_table: Any,
    token_start: int,
    token_end: int,
    layer_start: int,
    layer_end: int,
    wire_offset: int,
    nbytes: int,
) -> tuple[int, str]: ...
def wire_nbytes(
    desc: CacheDesc, token_start: int, token_end: int, layer_start: int, layer_end: int
) -> int: ...
def xxh3_64(data: Any) -> int: ...
def cuda_device_count() -> int: ...
def status_name(status: int) -> str: ...

class FleetCore:
    """The fleet router's state and choices (csrc/fleet/; kvbridge/fleet/core.py is the API)."""

    def __init__(self, load_factor: float, max_pages: int) -> None: ...
    def add(self, roles: int, queued_tokens: int, active_transfers: int) -> int: ...
    def update(self, slot: int, roles: int, queued_tokens: int, active_transfers: int) -> None: ...
    def remove(self, slot: int) -> None: ...
    def eject(self, slot: int) -> None: ...
    def note(self, slot: int, hashes: Sequence[bytes]) -> None: ...
    def choose(
        self, hashes: Sequence[bytes], kept: int, page_tokens: int
    ) -> tuple[int, int, int, int]: ...
    def commit(
        self, prefill: int, main: int, relay: int, tokens: int, main_held: int, prefill_held: int
    ) -> None: ...
    def prefilled(self, prefill: int, tokens: int) -> None: ...
    def finish(self, prefill: int, main: int, relay: int, tokens: int) -> None: ...
    def load(self, slot: int, active: int, routed_tokens: int) -> None: ...
    def least(self, role: int) -> int: ...
    def members(self, role: int) -> list[int]: ...
    def active(self, slot: int) -> int: ...
    def queued(self, slot: int) -> int: ...
    def pages(self, slot: int) -> list[bytes]: ...
    def index_size(self) -> int: ...
