"""Pack and unpack KV-cache pages: the Python face of the C++/CUDA core.

:func:`pack` gathers the tokens ``[start, end)`` (and a layer range) of one
request from a paged cache into the canonical wire layout (see
:mod:`kvbridge.layout`); :func:`unpack` scatters wire bytes into another cache,
whatever its page size and memory order.  Both work on any byte slice
``[offset, offset + nbytes)`` of the range's wire buffer, so a receiver can
unpack chunks in any order as they arrive.

Caches and buffers are numpy arrays or torch tensors, on the CPU or on a CUDA
device; nothing is copied on the way in.  Everything is validated before any
byte moves: a bad argument raises a typed :mod:`kvbridge.errors` exception and
leaves every buffer untouched.
"""

from __future__ import annotations

import operator
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np

from .errors import (
    BufferTooSmall,
    DTypeError,
    InvalidArgument,
    PageIndexError,
    ShapeError,
    Unavailable,
    raise_for_status,
)
from .layout import DType, KVLayout, MemoryOrder

_core: Any
try:
    from . import _core

    HAS_CORE = True
except ImportError:  # the extension was not built (e.g. a bare source checkout)
    _core = None
    HAS_CORE = False

__all__ = [
    "BUILT_WITH_CUDA",
    "HAS_CORE",
    "PagedKVCache",
    "cuda_available",
    "pack",
    "unpack",
    "wire_nbytes",
]

#: The core was compiled with the CUDA kernels.
BUILT_WITH_CUDA: bool = bool(_core.BUILT_WITH_CUDA) if _core is not None else False

# numpy has no bf16 / fp8: their bytes travel as uint16 / uint8 arrays.
_NUMPY_DTYPES: dict[DType, np.dtype[Any]] = {
    DType.FP32: np.dtype(np.float32),
    DType.FP16: np.dtype(np.float16),
    DType.BF16: np.dtype(np.uint16),
    DType.FP8_E4M3: np.dtype(np.uint8),
    DType.FP8_E5M2: np.dtype(np.uint8),
}
_TORCH_DTYPES: dict[DType, str] = {
    DType.FP32: "float32",
    DType.FP16: "float16",
    DType.BF16: "bfloat16",
    DType.FP8_E4M3: "float8_e4m3fn",
    DType.FP8_E5M2: "float8_e5m2",
}
_INT32_MAX = 2**31 - 1


def cuda_available() -> bool:
    """True when the core has CUDA kernels and a usable GPU is present now."""
    return _core is not None and BUILT_WITH_CUDA and _core.cuda_device_count() > 0


def _torch() -> Any:
    """The torch module if it is already imported (a tensor cannot exist otherwise)."""
    return sys.modules.get("torch")


def _is_tensor(x: object) -> bool:
    torch = _torch()
    return torch is not None and isinstance(x, torch.Tensor)


def _require_core() -> Any:
    if _core is None:
        raise Unavailable("kvbridge._core is not built: install kvbridge (make build)")
    return _core


def _device_of(x: Any) -> str:
    if _is_tensor(x):
        dev = x.device
        return "cpu" if dev.type == "cpu" else f"{dev.type}:{dev.index or 0}"
    return "cpu"


def _data_ptr(x: Any) -> int:
    if _is_tensor(x):
        return int(x.data_ptr())
    return int(x.__array_interface__["data"][0])


class PagedKVCache:
    """One engine's paged KV cache: a :class:`KVLayout` plus its memory.

    ``tensors`` is a list of ``layout.num_layers`` arrays of
    ``layout.layer_shape(P)``, or one array of ``layout.cache_shape(P)``
    (layers stacked on axis 0).  numpy arrays or torch tensors, C-contiguous,
    all on one device, of the layout's dtype (numpy: ``uint16`` for bf16 and
    ``uint8`` for fp8).  The cache keeps references to them; they must not be
    resized while it is in use.
    """

    def __init__(self, layout: KVLayout, tensors: Any) -> None:
        if not isinstance(layout, KVLayout):
            raise InvalidArgument(f"layout must be a KVLayout, got {type(layout).__name__}")
        self._layout = layout
        stacked = isinstance(tensors, np.ndarray) or _is_tensor(tensors)
        if stacked:
            arrays = [tensors]
        elif isinstance(tensors, Sequence) and not isinstance(tensors, (str, bytes)):
            arrays = list(tensors)
        else:
            raise InvalidArgument(
                "tensors must be one stacked array or a list of per-layer arrays, "
                f"got {type(tensors).__name__}"
            )
        for a in arrays:
            if not (isinstance(a, np.ndarray) or _is_tensor(a)):
                raise InvalidArgument(
                    f"cache arrays must be numpy or torch, got {type(a).__name__}"
                )
        self._backend = "torch" if _is_tensor(arrays[0]) else "numpy"
        if any((_is_tensor(a)) != (self._backend == "torch") for a in arrays):
            raise InvalidArgument("cache arrays mix numpy and torch")
        self._device = _device_of(arrays[0])
        if self._device != "cpu" and not self._device.startswith("cuda:"):
            raise InvalidArgument(f"caches live on the CPU or a CUDA device, not {self._device}")
        if any(_device_of(a) != self._device for a in arrays):
            raise InvalidArgument("cache arrays are on different devices")
        for a in arrays:
            self._check_dtype(a)
            contiguous = a.is_contiguous() if _is_tensor(a) else a.flags.c_contiguous
            if not contiguous:
                raise ShapeError("cache arrays must be C-contiguous")

        if stacked:
            shape = tuple(arrays[0].shape)
            if len(shape) < 1 or shape[0] != layout.num_layers:
                raise ShapeError(
                    f"stacked cache shape {shape}: axis 0 must be the {layout.num_layers} layers"
                )
            self._num_pages = self._pages_from_shape(shape[1:])
            if shape != layout.cache_shape(self._num_pages):
                raise ShapeError(
                    f"stacked cache shape {shape} != {layout.cache_shape(self._num_pages)}"
                )
            layer_bytes = layout.layer_numel(self._num_pages) * layout.itemsize
            base = _data_ptr(arrays[0])
            ptrs = [base + i * layer_bytes for i in range(layout.num_layers)]
        else:
            if len(arrays) != layout.num_layers:
                raise ShapeError(f"got {len(arrays)} layer arrays for {layout.num_layers} layers")
            self._num_pages = self._pages_from_shape(tuple(arrays[0].shape))
            want = layout.layer_shape(self._num_pages)
            for i, a in enumerate(arrays):
                if tuple(a.shape) != want:
                    raise ShapeError(f"layer {i} has shape {tuple(a.shape)}, expected {want}")
            ptrs = [_data_ptr(a) for a in arrays]
        self._tensors = tensors
        self._arrays = arrays
        self._stacked = stacked
        self._layer_ptrs = tuple(ptrs)
        self._desc: Any = None
        if _core is not None:
            sc, sp, st, sh = layout.byte_strides(self._num_pages)
            dev = -1 if self._device == "cpu" else int(self._device.split(":")[1])
            self._desc = _core.CacheDesc(
                list(ptrs),
                layout.num_components,
                layout.num_kv_heads,
                layout.head_bytes,
                layout.page_tokens,
                self._num_pages,
                sc,
                sp,
                st,
                sh,
                dev,
            )

    def _check_dtype(self, a: Any) -> None:
        dt = self._layout.dtype
        if _is_tensor(a):
            want = getattr(_torch(), _TORCH_DTYPES[dt], None)
            if want is None or a.dtype != want:
                raise DTypeError(f"cache tensor dtype {a.dtype}, layout needs {dt.value}")
        elif a.dtype != _NUMPY_DTYPES[dt]:
            raise DTypeError(
                f"cache array dtype {a.dtype}, layout {dt.value} needs numpy {_NUMPY_DTYPES[dt]}"
            )

    def _pages_from_shape(self, shape: tuple[int, ...]) -> int:
        lay = self._layout
        if len(shape) != len(lay.layer_shape(1)):
            raise ShapeError(f"layer shape {shape} has the wrong rank for {lay.layer_shape(1)}")
        axis = 0 if lay.mla or lay.order is MemoryOrder.PAGE_FIRST else 1
        return int(shape[axis])

    # ---- construction -------------------------------------------------------
    @classmethod
    def allocate(
        cls,
        layout: KVLayout,
        num_pages: int,
        *,
        backend: str = "numpy",
        device: str = "cpu",
        fill: int | str | None = None,
        seed: int = 0,
    ) -> PagedKVCache:
        """A new cache of ``num_pages`` pages (stacked iff ``layout.stacked``).

        ``fill``: None for zeros, an int for that byte value everywhere, or
        ``"random"`` for random bytes (from ``seed``).
        """
        num_pages = operator.index(num_pages)
        if num_pages < 0:
            raise InvalidArgument(f"num_pages must be >= 0, got {num_pages}")
        shapes = (
            [layout.cache_shape(num_pages)]
            if layout.stacked
            else [layout.layer_shape(num_pages)] * layout.num_layers
        )
        rng = np.random.default_rng(seed)
        arrays: list[Any] = []
        for shape in shapes:
            nbytes = int(np.prod(shape)) * layout.itemsize
            if fill is None:
                raw = np.zeros(nbytes, dtype=np.uint8)
            elif fill == "random":
                raw = rng.integers(0, 256, size=nbytes, dtype=np.uint8)
            elif isinstance(fill, int) and 0 <= fill <= 255:
                raw = np.full(nbytes, fill, dtype=np.uint8)
            else:
                raise InvalidArgument(f"fill must be None, a byte value or 'random', got {fill!r}")
            if backend == "numpy":
                if device != "cpu":
                    raise InvalidArgument("numpy caches live on the CPU")
                arrays.append(raw.view(_NUMPY_DTYPES[layout.dtype]).reshape(shape))
            elif backend == "torch":
                import torch

                t = torch.from_numpy(raw).to(device)
                arrays.append(t.view(getattr(torch, _TORCH_DTYPES[layout.dtype])).reshape(shape))
            else:
                raise InvalidArgument(f"backend must be 'numpy' or 'torch', got {backend!r}")
        return cls(layout, arrays[0] if layout.stacked else arrays)

    # ---- properties ---------------------------------------------------------
    @property
    def layout(self) -> KVLayout:
        return self._layout

    @property
    def num_pages(self) -> int:
        return self._num_pages

    @property
    def device(self) -> str:
        """``"cpu"`` or ``"cuda:N"``."""
        return self._device

    @property
    def is_cuda(self) -> bool:
        return self._device != "cpu"

    @property
    def backend(self) -> str:
        """``"numpy"`` or ``"torch"``."""
        return self._backend

    @property
    def tensors(self) -> Any:
        """What the cache was built from (the stacked array or the list)."""
        return self._tensors

    @property
    def layer_ptrs(self) -> tuple[int, ...]:
        """Address of each layer's first byte."""
        return self._layer_ptrs

    @property
    def layer_nbytes(self) -> int:
        """Bytes of one layer's memory."""
        return self._layout.layer_numel(self._num_pages) * self._layout.itemsize

    def layer_views(self) -> list[Any]:
        """One array per layer (views into a stacked array; no copies)."""
        if self._stacked:
            return [self._arrays[0][i] for i in range(self._layout.num_layers)]
        return list(self._arrays)

    def __repr__(self) -> str:
        return (
            f"PagedKVCache({self._layout.describe()}; {self._num_pages} pages on "
            f"{self._device}, {self._backend})"
        )


# ---- argument plumbing ------------------------------------------------------------
def _index(value: Any, name: str) -> int:
    if isinstance(value, bool):
        raise InvalidArgument(f"{name} must be an int, got a bool")
    try:
        return operator.index(value)
    except TypeError:
        raise InvalidArgument(f"{name} must be an int, got {type(value).__name__}") from None


def _token_range(start: Any, end: Any) -> tuple[int, int]:
    s, e = _index(start, "start"), _index(end, "end")
    if not 0 <= s <= e:
        raise InvalidArgument(f"bad token range [{s}, {e})")
    return s, e


def _block_table(block_table: Any) -> np.ndarray[Any, np.dtype[np.int32]]:
    """A host int32 C-contiguous copy or view of the table."""
    if _is_tensor(block_table):
        if block_table.is_floating_point() or block_table.is_complex():
            raise DTypeError(f"block_table must hold integers, got {block_table.dtype}")
        block_table = block_table.detach().cpu().numpy()
    if isinstance(block_table, np.ndarray):
        arr = block_table
    else:
        try:
            arr = np.asarray(block_table)
        except (OverflowError, ValueError, TypeError) as e:
            raise InvalidArgument(f"block_table is not an int array: {e}") from None
        if arr.size == 0:
            arr = arr.astype(np.int64)
    if arr.dtype.kind not in "iu":
        raise DTypeError(f"block_table must hold integers, got {arr.dtype}")
    if arr.ndim != 1:
        raise ShapeError(f"block_table must be 1-D, got shape {arr.shape}")
    if arr.size and (int(arr.min()) < -_INT32_MAX - 1 or int(arr.max()) > _INT32_MAX):
        raise PageIndexError("block_table holds page ids outside int32")
    return np.ascontiguousarray(arr, dtype=np.int32)


def _as_bytes(buf: Any, *, writable: bool, cache: PagedKVCache, what: str) -> Any:
    """A flat uint8 view of ``buf`` (no copy), checked for contiguity and device."""
    if isinstance(buf, (bytes, bytearray, memoryview)):
        if writable and isinstance(buf, bytes):
            raise InvalidArgument(f"{what} is read-only (bytes)")
        try:
            buf = np.frombuffer(buf, dtype=np.uint8)
        except (ValueError, TypeError) as e:
            raise ShapeError(f"{what} is not a contiguous byte buffer: {e}") from None
    if isinstance(buf, np.ndarray):
        if not buf.flags.c_contiguous:
            raise ShapeError(f"{what} must be C-contiguous")
        if writable and not buf.flags.writeable:
            raise InvalidArgument(f"{what} is read-only")
        return buf.reshape(-1).view(np.uint8)
    if _is_tensor(buf):
        if not buf.is_contiguous():
            raise ShapeError(f"{what} must be contiguous")
        dev = _device_of(buf)
        if dev != "cpu" and dev != cache.device:
            raise InvalidArgument(f"{what} is on {dev}; the cache is on {cache.device}")
        torch = _torch()
        return buf.detach().reshape(-1).view(torch.uint8)
    raise InvalidArgument(
        f"{what} must be a numpy array, a torch tensor or a byte buffer, got {type(buf).__name__}"
    )


def _nbytes(view: Any) -> int:
    return int(view.nbytes) if isinstance(view, np.ndarray) else int(view.numel())


def _new_buffer(cache: PagedKVCache, nbytes: int) -> Any:
    if cache.backend == "torch":
        import torch

        return torch.empty(nbytes, dtype=torch.uint8, device=cache.device)
    return np.empty(nbytes, dtype=np.uint8)


def _stream(cache: PagedKVCache, stream: Any) -> int:
    if not cache.is_cuda:
        return 0
    if not BUILT_WITH_CUDA:
        raise Unavailable("the cache is on CUDA but kvbridge was built without CUDA")
    if stream is None:
        import torch

        return int(torch.cuda.current_stream(torch.device(cache.device)).cuda_stream)
    if hasattr(stream, "cuda_stream"):
        return int(stream.cuda_stream)
    handle = _index(stream, "stream")
    if handle < 0:
        raise InvalidArgument(f"stream handle must be >= 0, got {handle}")
    return handle


def _threads(num_threads: Any) -> int:
    n = _index(num_threads, "num_threads")
    if n < 0:
        raise InvalidArgument(f"num_threads must be >= 0, got {n}")
    return n


def _slice(total: int, offset: Any, nbytes: int | None) -> tuple[int, int]:
    off = _index(offset, "offset")
    if off < 0 or off > total:
        raise InvalidArgument(f"offset {off} is outside the {total}-byte wire buffer")
    n = total - off if nbytes is None else _index(nbytes, "nbytes")
    if n < 0 or off + n > total:
        raise InvalidArgument(f"slice [{off}, {off}+{n}) is outside the {total}-byte wire buffer")
    return off, n


def wire_nbytes(
    layout: KVLayout, start: int, end: int, layers: tuple[int, int] | None = None
) -> int:
    """Bytes of the wire buffer of tokens ``[start, end)`` and a layer range."""
    s, e = _token_range(start, end)
    return layout.wire_nbytes(e - s, layers)


def pack(
    cache: PagedKVCache,
    block_table: Any,
    start: int,
    end: int,
    *,
    layers: tuple[int, int] | None = None,
    out: Any = None,
    offset: int = 0,
    nbytes: int | None = None,
    num_threads: int = 0,
    stream: Any = None,
) -> Any:
    """Gather bytes ``[offset, offset + nbytes)`` of the wire buffer of tokens
    ``[start, end)`` (and ``layers``, default all) into ``out``; return ``out``.

    ``block_table[i]`` is the page holding tokens ``[i*pt, (i+1)*pt)``.  With
    ``out=None`` a uint8 buffer of the cache's backend and device is allocated;
    otherwise the first ``nbytes`` bytes of ``out`` are written.  ``nbytes``
    defaults to the rest of the wire buffer.  CUDA caches run on ``stream``
    (None: torch's current stream; an int handle or a torch stream).
    """
    core = _require_core()
    if not isinstance(cache, PagedKVCache):
        raise InvalidArgument(f"cache must be a PagedKVCache, got {type(cache).__name__}")
    s, e = _token_range(start, end)
    l0, l1 = cache.layout.layer_range(layers)
    total = cache.layout.wire_nbytes(e - s, (l0, l1))
    off, n = _slice(total, offset, nbytes)
    table = _block_table(block_table)
    threads = _threads(num_threads)
    handle = _stream(cache, stream)
    if out is None:
        out = _new_buffer(cache, n)
    view = _as_bytes(out, writable=True, cache=cache, what="out")
    if _nbytes(view) < n:
        raise BufferTooSmall(f"out holds {_nbytes(view)} bytes; the slice needs {n}")
    rc, msg = core.pack(cache._desc, table, s, e, l0, l1, off, view, n, threads, handle)
    raise_for_status(rc, msg)
    return out


def unpack(
    cache: PagedKVCache,
    block_table: Any,
    start: int,
    end: int,
    src: Any,
    *,
    layers: tuple[int, int] | None = None,
    offset: int = 0,
    nbytes: int | None = None,
    num_threads: int = 0,
    stream: Any = None,
) -> None:
    """Scatter ``src`` -- bytes ``[offset, offset + nbytes)`` of the wire buffer
    of tokens ``[start, end)`` (and ``layers``) -- into the cache.

    ``nbytes`` defaults to all of ``src``: a chunk of the wire buffer is
    unpacked by passing it with its offset, in any order.  On an error nothing
    is written.
    """
    core = _require_core()
    if not isinstance(cache, PagedKVCache):
        raise InvalidArgument(f"cache must be a PagedKVCache, got {type(cache).__name__}")
    s, e = _token_range(start, end)
    l0, l1 = cache.layout.layer_range(layers)
    total = cache.layout.wire_nbytes(e - s, (l0, l1))
    view = _as_bytes(src, writable=False, cache=cache, what="src")
    have = _nbytes(view)
    if nbytes is not None and _index(nbytes, "nbytes") > have:
        raise BufferTooSmall(f"src holds {have} bytes; nbytes={nbytes}")
    off, n = _slice(total, offset, have if nbytes is None else nbytes)
    table = _block_table(block_table)
    threads = _threads(num_threads)
    handle = _stream(cache, stream)
    rc, msg = core.unpack(cache._desc, table, s, e, l0, l1, off, view, n, threads, handle)
    raise_for_status(rc, msg)
