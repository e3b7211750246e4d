"""Argument plumbing of the pack API: the compiled core, dtype tables, and
the checks that turn numpy arrays, torch tensors, block tables, slices,
streams and thread counts into what the core takes (typed errors otherwise)."""

from __future__ import annotations

import operator
import sys
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import (
    DTypeError,
    InvalidArgument,
    ShapeError,
    Unavailable,
)
from ..layout import DType

if TYPE_CHECKING:
    from .cache import PagedKVCache

_core: Any
try:
    from .. import _core

    HAS_CORE = True
except ImportError:  # the extension was not built (e.g. a bare source checkout)
    _core = None
    HAS_CORE = False

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


def _byte_strides(x: Any) -> tuple[int, ...]:
    """Strides in bytes (numpy already counts bytes; torch counts elements)."""
    if _is_tensor(x):
        return tuple(int(s) * int(x.element_size()) for s in x.stride())
    return tuple(int(s) for s in x.strides)


def _check_arrays(arrays: list[Any]) -> tuple[str, str]:
    """(backend, device) of a homogeneous list of numpy arrays or torch tensors."""
    if not arrays:
        raise InvalidArgument("no cache arrays")
    for a in arrays:
        if not (isinstance(a, np.ndarray) or _is_tensor(a)):
            raise InvalidArgument(f"cache arrays must be numpy or torch, got {type(a).__name__}")
    backend = "torch" if _is_tensor(arrays[0]) else "numpy"
    if any(_is_tensor(a) != (backend == "torch") for a in arrays):
        raise InvalidArgument("cache arrays mix numpy and torch")
    device = _device_of(arrays[0])
    if device != "cpu" and not device.startswith("cuda:"):
        raise InvalidArgument(f"caches live on the CPU or a CUDA device, not {device}")
    if any(_device_of(a) != device for a in arrays):
        raise InvalidArgument("cache arrays are on different devices")
    for a in arrays:
        if any(s < 0 for s in _byte_strides(a)):
            raise ShapeError("cache arrays with negative strides are not supported")
    return backend, device


def _check_dtype(dt: DType, a: Any) -> None:
    if _is_tensor(a):
        want = getattr(_torch(), _TORCH_DTYPES[dt], None)
        if want is None or a.dtype != want:
            raise DTypeError(f"cache tensor dtype {a.dtype}, layout needs {dt.value}")
    elif a.dtype != _NUMPY_DTYPES[dt]:
        raise DTypeError(
            f"cache array dtype {a.dtype}, layout {dt.value} needs numpy {_NUMPY_DTYPES[dt]}"
        )


def _torch_kv_dtype(t: Any, dtype: DType | str | None) -> DType:
    """The KV dtype of an engine's tensor (uint8 tensors need an explicit fp8 dtype)."""
    torch = _torch()
    if dtype is not None:
        dt = DType.parse(dtype)
        if t.element_size() != dt.itemsize:
            raise DTypeError(f"tensor elements are {t.element_size()} bytes; {dt.value} needs "
                             f"{dt.itemsize}")  # fmt: skip
        if t.dtype != torch.uint8 and t.dtype != getattr(torch, _TORCH_DTYPES[dt]):
            raise DTypeError(f"tensor dtype {t.dtype} is not {dt.value}")
        return dt
    if t.dtype == torch.uint8:
        raise DTypeError("a uint8 KV cache is fp8: pass dtype='fp8_e4m3' or 'fp8_e5m2'")
    return DType.parse(t.dtype)


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


def _nbytes(view: Any) -> int:
    return int(view.nbytes) if isinstance(view, np.ndarray) else int(view.numel())


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


WIRE_ALIGN = 64


def aligned_empty(
    nbytes: int, align: int = WIRE_ALIGN, *, zeroed: bool = False
) -> np.ndarray[Any, np.dtype[np.uint8]]:
    """A host byte buffer of ``nbytes`` whose first byte is ``align``-aligned
    (a power of two; 64 by default: a cache line), uninitialised, or zeroed
    (lazily, as ``np.zeros``: pages the kernel zeroes on first touch).

    numpy's own buffers start where ``malloc`` puts them, 16 bytes past a
    4 KiB page for large ones, so a pack into one writes each cache line in
    two parts and with 16-byte stores.  Measured on a 2-core AMD EPYC VM
    (``bench/bench_pack_alignment.py``; two threads, 64 MiB, huge pages,
    rounds interleaved): vLLM LBHNC 16-token blocks 17.1-17.2 GB/s into a
    buffer at 16 bytes past a line against 18.9-20.0 from a line's start,
    random 16 KiB pages 18.1-20.8 against 21.3-24.5 (docs/pack.md).  The
    array keeps the larger allocation alive."""
    nbytes = operator.index(nbytes)
    if nbytes < 0:
        raise InvalidArgument(f"nbytes must be >= 0, got {nbytes}")
    if align <= 0 or align & (align - 1):
        raise InvalidArgument(f"align must be a power of two, got {align}")
    raw = (np.zeros if zeroed else np.empty)(nbytes + align - 1, dtype=np.uint8)
    start = -raw.ctypes.data % align
    return raw[start : start + nbytes]


def _new_buffer(cache: PagedKVCache, nbytes: int) -> Any:
    if cache.backend == "torch":
        import torch

        # torch's CPU allocator aligns to 64 bytes already
        return torch.empty(nbytes, dtype=torch.uint8, device=cache.device)
    if cache.is_cuda:
        raise InvalidArgument("a CUDA cache built from pointers needs an `out` buffer")
    return aligned_empty(nbytes)


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
