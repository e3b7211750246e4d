"""Every bad input raises its typed error and leaves every buffer untouched."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch

from kvbridge import errors
from kvbridge.layout import KVLayout
from kvbridge.pack import (
    BUILT_WITH_CUDA,
    HAS_CORE,
    PagedKVCache,
    cuda_available,
    pack,
    unpack,
    wire_nbytes,
)

pytestmark = pytest.mark.skipif(not HAS_CORE, reason="kvbridge._core is not built")

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=4, dtype="fp16", page_tokens=4)
BT = [3, 1, 0, 2]
START, END = 2, 14
TOTAL = wire_nbytes(LAYOUT, START, END)


@pytest.fixture
def cache() -> PagedKVCache:
    return PagedKVCache.allocate(LAYOUT, 4, fill="random", seed=5)


@pytest.fixture
def wire(cache: PagedKVCache) -> np.ndarray:
    return pack(cache, BT, START, END)


def unchanged(cache: PagedKVCache, fn: Callable[[], object], exc: type[Exception]) -> None:
    before = [v.copy() for v in cache.layer_views()]
    with pytest.raises(exc) as info:
        fn()
    assert str(info.value)
    for a, b in zip(before, cache.layer_views(), strict=True):
        np.testing.assert_array_equal(a, b)


# ---- block tables --------------------------------------------------------------
@pytest.mark.parametrize(
    "table",
    [[3, 1, 4, 2], [3, 1, -1, 2], [3, 1, 0], [3, 1, 0, 2**31], [3, 1, 0, 2**40]],
    ids=["page-too-large", "negative", "table-too-short", "above-int32", "huge"],
)
def test_bad_page_ids(cache: PagedKVCache, wire: np.ndarray, table: list[int]) -> None:
    unchanged(cache, lambda: pack(cache, table, START, END), errors.PageIndexError)
    unchanged(cache, lambda: unpack(cache, table, START, END, wire), errors.PageIndexError)
    # A table that is bad only past the range is fine.
    pack(cache, [*BT, 99], START, END)


def test_repeated_page_on_unpack_is_overlap(cache: PagedKVCache, wire: np.ndarray) -> None:
    table = [3, 1, 3, 2]
    pack(cache, table, START, END)  # reading a page twice is harmless
    unchanged(cache, lambda: unpack(cache, table, START, END, wire), errors.OverlapError)
    unchanged(cache, lambda: unpack(cache, table, START, END, wire[:10]), errors.OverlapError)


def test_aliased_layers_on_unpack_are_overlap(wire: np.ndarray) -> None:
    layer = np.zeros(LAYOUT.layer_shape(4), np.float16)
    aliased = PagedKVCache(LAYOUT, [layer, layer])
    pack(aliased, BT, START, END)
    unchanged(aliased, lambda: unpack(aliased, BT, START, END, wire), errors.OverlapError)


def test_wire_buffer_inside_the_cache_is_overlap(cache: PagedKVCache) -> None:
    inside = cache.layer_views()[1].reshape(-1).view(np.uint8)
    unchanged(
        cache, lambda: pack(cache, BT, START, END, out=inside, nbytes=100), errors.OverlapError
    )
    unchanged(cache, lambda: unpack(cache, BT, START, END, inside[:100]), errors.OverlapError)


@pytest.mark.parametrize(
    "table,exc",
    [
        ([1.0, 2.0, 0.0, 3.0], errors.DTypeError),
        ([[3, 1], [0, 2]], errors.ShapeError),
        (["a", "b"], errors.DTypeError),
        (torch.tensor([3.0, 1.0]), errors.DTypeError),
    ],
    ids=["float", "2d", "strings", "torch-float"],
)
def test_bad_block_table_types(cache: PagedKVCache, table: object, exc: type[Exception]) -> None:
    unchanged(cache, lambda: pack(cache, table, START, END), exc)


# ---- buffers and slices --------------------------------------------------------
def test_out_too_small(cache: PagedKVCache) -> None:
    small = np.zeros(TOTAL - 1, np.uint8)
    with pytest.raises(errors.BufferTooSmall):
        pack(cache, BT, START, END, out=small)
    assert not small.any()
    with pytest.raises(errors.BufferTooSmall):
        pack(cache, BT, START, END, out=torch.zeros(3, dtype=torch.uint8))


def test_src_smaller_than_nbytes(cache: PagedKVCache, wire: np.ndarray) -> None:
    unchanged(
        cache, lambda: unpack(cache, BT, START, END, wire[:10], nbytes=11), errors.BufferTooSmall
    )


@pytest.mark.parametrize(
    "offset,nbytes", [(TOTAL + 1, 0), (-1, 4), (TOTAL - 4, 5), (0, TOTAL + 1), (3, -1)]
)
def test_slice_outside_the_wire_buffer(cache: PagedKVCache, offset: int, nbytes: int) -> None:
    out = np.zeros(TOTAL + 8, np.uint8)
    with pytest.raises(errors.InvalidArgument):
        pack(cache, BT, START, END, out=out, offset=offset, nbytes=nbytes)
    assert not out.any()


def test_src_past_the_end_of_the_wire_buffer(cache: PagedKVCache, wire: np.ndarray) -> None:
    unchanged(cache, lambda: unpack(cache, BT, START, END, wire, offset=1), errors.InvalidArgument)
    too_long = np.concatenate([wire, wire[:1]])
    unchanged(cache, lambda: unpack(cache, BT, START, END, too_long), errors.InvalidArgument)


def test_out_must_be_writable_and_contiguous(cache: PagedKVCache) -> None:
    ro = np.zeros(TOTAL, np.uint8)
    ro.flags.writeable = False
    with pytest.raises(errors.InvalidArgument):
        pack(cache, BT, START, END, out=ro)
    with pytest.raises(errors.InvalidArgument):
        pack(cache, BT, START, END, out=bytes(TOTAL))
    with pytest.raises(errors.ShapeError):
        pack(cache, BT, START, END, out=np.zeros(2 * TOTAL, np.uint8)[::2])
    with pytest.raises(errors.ShapeError):
        pack(cache, BT, START, END, out=torch.zeros(2 * TOTAL, dtype=torch.uint8)[::2])
    with pytest.raises(errors.InvalidArgument):
        pack(cache, BT, START, END, out=[0] * TOTAL)


def test_src_must_be_contiguous(cache: PagedKVCache, wire: np.ndarray) -> None:
    strided = np.repeat(wire, 2)[::2]
    unchanged(cache, lambda: unpack(cache, BT, START, END, strided), errors.ShapeError)


# ---- ranges and knobs ----------------------------------------------------------
@pytest.mark.parametrize(
    "start,end,layers",
    [(5, 4, None), (-1, 4, None), (0, 4, (1, 3)), (0, 4, (2, 1)), (True, 4, None), (0.0, 4, None)],
    ids=["end-before-start", "negative", "layers-past", "layers-reversed", "bool", "float"],
)
def test_bad_ranges(cache: PagedKVCache, start: object, end: int, layers: object) -> None:
    with pytest.raises(errors.InvalidArgument):
        pack(cache, BT, start, end, layers=layers)  # type: ignore[arg-type]
    with pytest.raises(errors.InvalidArgument):
        wire_nbytes(LAYOUT, start, end, layers)  # type: ignore[arg-type]


def test_bad_num_threads_and_stream(cache: PagedKVCache) -> None:
    with pytest.raises(errors.InvalidArgument):
        pack(cache, BT, START, END, num_threads=-1)
    with pytest.raises(errors.InvalidArgument):
        pack(cache, BT, START, END, num_threads="2")  # type: ignore[arg-type]


def test_not_a_cache() -> None:
    with pytest.raises(errors.InvalidArgument):
        pack(np.zeros(4), BT, 0, 4)  # type: ignore[arg-type]
    with pytest.raises(errors.InvalidArgument):
        unpack("cache", BT, 0, 4, b"")  # type: ignore[arg-type]


# ---- cache construction ------------------------------------------------------------
def test_wrong_dtypes() -> None:
    with pytest.raises(errors.DTypeError):
        PagedKVCache(LAYOUT, [np.zeros(LAYOUT.layer_shape(2), np.float32)] * 2)
    bf16 = LAYOUT.replace(dtype="bf16")
    with pytest.raises(errors.DTypeError):
        PagedKVCache(bf16, [np.zeros(bf16.layer_shape(2), np.float16) for _ in range(2)])
    with pytest.raises(errors.DTypeError):
        PagedKVCache(
            bf16, [torch.zeros(bf16.layer_shape(2), dtype=torch.float16) for _ in range(2)]
        )
    with pytest.raises(errors.DTypeError):  # torch takes real dtypes, not byte stand-ins
        PagedKVCache(bf16, [torch.zeros(bf16.layer_shape(2), dtype=torch.int16) for _ in range(2)])
    fp8 = LAYOUT.replace(dtype="fp8_e4m3")
    with pytest.raises(errors.DTypeError):
        PagedKVCache(fp8, [torch.zeros(fp8.layer_shape(2), dtype=torch.uint8) for _ in range(2)])
    PagedKVCache(fp8, [np.zeros(fp8.layer_shape(2), np.uint8) for _ in range(2)])
    PagedKVCache(bf16, [torch.zeros(bf16.layer_shape(2), dtype=torch.bfloat16) for _ in range(2)])


def test_wrong_shapes() -> None:
    good = LAYOUT.layer_shape(3)
    with pytest.raises(errors.ShapeError):
        PagedKVCache(LAYOUT, [np.zeros(good, np.float16)])  # one layer of two
    with pytest.raises(errors.ShapeError):
        PagedKVCache(
            LAYOUT, [np.zeros(good, np.float16), np.zeros(LAYOUT.layer_shape(4), np.float16)]
        )
    with pytest.raises(errors.ShapeError):
        PagedKVCache(LAYOUT, [np.zeros((*good, 1), np.float16)] * 2)
    with pytest.raises(errors.ShapeError):
        PagedKVCache(LAYOUT, np.zeros((3, *good), np.float16))  # stacked with 3 layers
    wrong_heads = (2, 3, 4, 3, 4)  # [2, P, pt, H=3, D]
    with pytest.raises(errors.ShapeError):
        PagedKVCache(LAYOUT, [np.zeros(wrong_heads, np.float16)] * 2)
    with pytest.raises(errors.ShapeError):  # negative strides
        PagedKVCache(LAYOUT, [np.zeros(good, np.float16)[:, ::-1]] * 2)


def test_overlapping_strides_are_a_layout_error() -> None:
    """A strided view whose distinct slots share bytes (torch's as_strided can
    make one) is refused when the cache is built, before any byte moves."""
    shape = LAYOUT.layer_shape(4)  # [2, 4, 4, 2, 4]

    def views(strides: tuple[int, ...]) -> list[torch.Tensor]:
        return [torch.as_strided(torch.zeros(4096, dtype=torch.float16), shape, strides)] * 2

    # Tokens 4 elements apart, but a token's two heads span 8: they overlap.
    with pytest.raises(errors.LayoutError, match="overlap"):
        PagedKVCache(LAYOUT, views((256, 64, 4, 4, 1)))
    # K and V 16 elements apart, inside one page's 32: they overlap.
    with pytest.raises(errors.LayoutError, match="overlap"):
        PagedKVCache(LAYOUT, views((16, 64, 8, 4, 1)))
    PagedKVCache(LAYOUT, views((32, 64, 8, 4, 1)))  # K and V pages interleaved: fine
    PagedKVCache(LAYOUT, views((512, 128, 16, 4, 1)))  # padded between tokens: fine


def test_mixed_backends_and_bad_inputs() -> None:
    shape = LAYOUT.layer_shape(2)
    with pytest.raises(errors.InvalidArgument):
        PagedKVCache(LAYOUT, [np.zeros(shape, np.float16), torch.zeros(shape, dtype=torch.float16)])
    with pytest.raises(errors.InvalidArgument):
        PagedKVCache(LAYOUT, "tensors")
    with pytest.raises(errors.InvalidArgument):
        PagedKVCache(LAYOUT, [[0.0] * 4] * 2)
    with pytest.raises(errors.InvalidArgument):
        PagedKVCache("layout", [np.zeros(shape, np.float16)] * 2)  # type: ignore[arg-type]
    with pytest.raises(errors.InvalidArgument):
        PagedKVCache.allocate(LAYOUT, 2, backend="jax")
    with pytest.raises(errors.InvalidArgument):
        PagedKVCache.allocate(LAYOUT, 2, fill=300)
    with pytest.raises(errors.InvalidArgument):
        PagedKVCache.allocate(LAYOUT, -1)
    with pytest.raises(errors.InvalidArgument):
        PagedKVCache.allocate(LAYOUT, 2, backend="numpy", device="cuda:0")
    with pytest.raises(errors.InvalidArgument):
        PagedKVCache(LAYOUT, [torch.zeros(shape, dtype=torch.float16, device="meta")] * 2)


def test_cuda_wire_for_a_cpu_cache_is_rejected(cache: PagedKVCache) -> None:
    meta = torch.empty(TOTAL, dtype=torch.uint8, device="meta")
    with pytest.raises(errors.InvalidArgument):
        pack(cache, BT, START, END, out=meta)


# ---- CUDA without a GPU -----------------------------------------------------------
def test_capability_flags() -> None:
    assert isinstance(BUILT_WITH_CUDA, bool)
    assert isinstance(cuda_available(), bool)
    if not BUILT_WITH_CUDA:
        assert not cuda_available()


@pytest.mark.skipif(cuda_available(), reason="checks the no-GPU path")
def test_cuda_path_without_a_gpu_is_unavailable(wire: np.ndarray) -> None:
    """The C CUDA entry point on a machine without a GPU (or without CUDA support
    compiled in) answers KVB_ERR_UNAVAILABLE, never a crash."""
    from kvbridge import _core

    layer = np.zeros(LAYOUT.layer_shape(4), np.float16)
    layers = [layer, layer.copy()]
    sc, sp, st, sh = LAYOUT.byte_strides(4)
    desc = _core.CacheDesc(
        [a.__array_interface__["data"][0] for a in layers], 2, 2, 8, 4, 4, sc, sp, st, sh, 0
    )
    table = np.asarray(BT, np.int32)
    rc, msg = _core.pack(desc, table, START, END, 0, 2, 0, np.zeros(TOTAL, np.uint8), TOTAL, 0, 0)
    with pytest.raises(errors.Unavailable, match="CUDA"):
        errors.raise_for_status(rc, msg)
    rc, msg = _core.unpack(desc, table, START, END, 0, 2, 0, wire, TOTAL, 0, 0)
    with pytest.raises(errors.Unavailable):
        errors.raise_for_status(rc, msg)
    assert not layers[0].any() and not layers[1].any()
