"""Type stubs of the nanobind module kvbridge._core (bindings/)."""

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
    ) -> None: ...

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
def cuda_device_count() -> int: ...
def status_name(status: int) -> str: ...
