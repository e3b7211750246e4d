"""Pack and unpack KV-cache pages: the Python face of the C++/CUDA core.

A :class:`PagedKVCache` describes one engine's cache: its :class:`KVLayout`
and, for every layer and component (K, V or the MLA latent), a base address
and the byte strides of page, token, head and element.  It is built from the
engine's tensors as they are -- kvbridge's own shapes (``PagedKVCache(layout,
tensors)``), vLLM's per-layer views (:meth:`PagedKVCache.from_vllm`), SGLang's
K and V buffers (:meth:`PagedKVCache.from_sglang`) or raw pointers
(:meth:`PagedKVCache.from_strided`) -- and checked once.

:meth:`PagedKVCache.range` checks one transfer's token range, layer range,
head range and block table once and returns a :class:`KVRange`, whose
:meth:`~KVRange.pack` gathers any byte slice ``[offset, offset + nbytes)`` of
the canonical wire layout (see :mod:`kvbridge.layout`) and whose
:meth:`~KVRange.unpack` scatters one, in any order; per chunk only the slice
and the buffer are checked.  On the CPU, pack can return the XXH3-64 of the
bytes it wrote and unpack can verify one, in the same pass as the copy.
:func:`pack` and :func:`unpack` do both steps per call.

Caches and buffers are numpy arrays or torch tensors, on the CPU or on a CUDA
device; nothing is copied on the way in.  Everything is validated before any
byte moves: a bad argument raises a typed :mod:`kvbridge.errors` exception and
leaves every buffer untouched.
"""

from __future__ import annotations

import itertools
import operator
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .errors import (
    BufferTooSmall,
    DTypeError,
    InvalidArgument,
    LayoutError,
    PageIndexError,
    ShapeError,
    Unavailable,
    raise_for_status,
)
from .layout import DType, HeadOrder, KVLayout, MemoryOrder

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
    "ComponentStrides",
    "KVRange",
    "PagedKVCache",
    "cuda_available",
    "pack",
    "unpack",
    "wire_nbytes",
    "xxh3_64",
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


def _byte_strides(x: Any) -> tuple[int, ...]:
    """Strides in bytes (numpy already counts bytes; torch counts elements)."""
    if _is_tensor(x):
        return tuple(int(s) * int(x.element_size()) for s in x.stride())
    return tuple(int(s) for s in x.strides)


@dataclass(frozen=True)
class ComponentStrides:
    """Byte strides of one component (K, V or the MLA latent) inside a layer:
    between pages, between the tokens of a page, between heads, and between
    the elements of a head (the element size when they are adjacent)."""

    page: int
    token: int
    head: int
    elem: int


class PagedKVCache:
    """One engine's paged KV cache: a :class:`KVLayout` plus its memory.

    ``PagedKVCache(layout, tensors)`` takes kvbridge's own shapes: a list of
    ``layout.num_layers`` arrays of ``layout.layer_shape(P)``, or one array of
    ``layout.cache_shape(P)`` (layers stacked on axis 0); numpy arrays or torch
    tensors, all on one device, of the layout's dtype (numpy: ``uint16`` for
    bf16 and ``uint8`` for fp8), with any strides that keep distinct slots
    apart (views into larger tensors work; the byte strides are read from the
    tensors).  The other constructors take engines' tensors as they are.

    ``block_tokens`` is how many tokens one block-table entry covers (default
    ``page_tokens``): vLLM's manager blocks can be a whole multiple of the
    kernel blocks its tensors are split into, and a block table in manager
    blocks is then mapped to kernel blocks (manager block ``b`` is kernel
    blocks ``b * r .. b * r + r - 1``, ``r = block_tokens / page_tokens``).

    The cache keeps references to its tensors; they must not be resized while
    it is in use.
    """

    def __init__(self, layout: KVLayout, tensors: Any, *, block_tokens: int | None = None) -> None:
        if not isinstance(layout, KVLayout):
            raise InvalidArgument(f"layout must be a KVLayout, got {type(layout).__name__}")
        if layout.order is MemoryOrder.STRIDED:
            raise LayoutError(
                "a strided layout's memory comes from the engine's tensors: use "
                "PagedKVCache.from_vllm, from_sglang or from_strided"
            )
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
        backend, device = _check_arrays(arrays)
        for a in arrays:
            _check_dtype(layout.dtype, a)
        if stacked:
            shape = tuple(arrays[0].shape)
            if len(shape) < 1 or shape[0] != layout.num_layers:
                raise ShapeError(
                    f"stacked cache shape {shape}: axis 0 must be the {layout.num_layers} layers"
                )
            num_pages = _pages_from_shape(layout, shape[1:])
            if shape != layout.cache_shape(num_pages):
                raise ShapeError(f"stacked cache shape {shape} != {layout.cache_shape(num_pages)}")
            all_strides = _byte_strides(arrays[0])
            layer_step, inner = all_strides[0], all_strides[1:]
            base = _data_ptr(arrays[0])
            layer_src = [(0, i * layer_step) for i in range(layout.num_layers)]
            layer_bases = [base + i * layer_step for i in range(layout.num_layers)]
        else:
            if len(arrays) != layout.num_layers:
                raise ShapeError(f"got {len(arrays)} layer arrays for {layout.num_layers} layers")
            num_pages = _pages_from_shape(layout, tuple(arrays[0].shape))
            want = layout.layer_shape(num_pages)
            for i, a in enumerate(arrays):
                if tuple(a.shape) != want:
                    raise ShapeError(f"layer {i} has shape {tuple(a.shape)}, expected {want}")
            inner = _byte_strides(arrays[0])
            for i, a in enumerate(arrays):
                if _byte_strides(a) != inner:
                    raise ShapeError(f"layer {i} has strides {_byte_strides(a)}, layer 0 {inner}")
            layer_src = [(i, 0) for i in range(layout.num_layers)]
            layer_bases = [_data_ptr(a) for a in arrays]
        comp_step, strides = _native_strides(layout, inner, num_pages)
        comps = layout.num_components
        ptrs = [[b + c * comp_step for c in range(comps)] for b in layer_bases]
        sources = [[(t, off + c * comp_step) for c in range(comps)] for t, off in layer_src]
        self._init(
            layout=layout,
            ptrs=ptrs,
            strides=[strides] * comps,
            num_pages=num_pages,
            device=device,
            backend=backend,
            tensors=tensors,
            arrays=arrays,
            sources=sources,
            block_tokens=block_tokens,
        )
        self._stacked = stacked

    def _init(
        self,
        *,
        layout: KVLayout,
        ptrs: list[list[int]],
        strides: list[ComponentStrides],
        num_pages: int,
        device: str,
        backend: str,
        tensors: Any,
        arrays: list[Any],
        sources: list[list[tuple[int, int]]] | None,
        block_tokens: int | None,
    ) -> None:
        self._layout = layout
        self._num_pages = int(num_pages)
        self._device = device
        self._backend = backend
        self._tensors = tensors
        self._arrays = arrays
        self._sources = sources
        self._stacked = False
        self._component_ptrs = tuple(tuple(int(p) for p in row) for row in ptrs)
        self._strides = tuple(strides)
        pt = layout.page_tokens
        if block_tokens is None:
            block_tokens = pt
        if (
            not isinstance(block_tokens, int)
            or isinstance(block_tokens, bool)
            or block_tokens <= 0
            or block_tokens % pt
        ):
            raise LayoutError(
                f"block_tokens {block_tokens!r} is not a whole multiple of the "
                f"{pt}-token pages (kernel blocks) of the cache"
            )
        self._block_tokens = block_tokens
        self._block_ratio = block_tokens // pt
        if self._num_pages % self._block_ratio:
            raise LayoutError(
                f"{self._num_pages} pages do not split into whole {block_tokens}-token blocks"
            )
        self._desc: Any = None
        if _core is None:
            return
        flat_strides = [v for s in self._strides for v in (s.page, s.token, s.head, s.elem)]
        flat_ptrs = [p for row in self._component_ptrs for p in row]
        dev = -1 if device == "cpu" else int(device.split(":")[1])
        self._desc = _core.CacheDesc(
            [],
            layout.num_components,
            layout.num_kv_heads,
            layout.head_bytes,
            pt,
            self._num_pages,
            0,
            0,
            0,
            0,
            dev,
            elem_bytes=layout.itemsize,
            component_strides=flat_strides,
            component_ptrs=flat_ptrs,
        )
        rc, msg = self._desc.open()
        raise_for_status(rc, msg)

    # ---- other engines' tensors -------------------------------------------------
    @classmethod
    def from_vllm(
        cls,
        kv_caches: Mapping[str, Any] | Sequence[Any],
        *,
        kv_split: str = "last_dim",
        mla: bool = False,
        dtype: DType | str | None = None,
        block_tokens: int | None = None,
        head_start: int = 0,
        model_kv_heads: int | None = None,
        name: str = "",
    ) -> PagedKVCache:
        """vLLM's KV cache (v0.26 and later; checked against 0.32.0), as its
        worker hands it to a KV connector's ``register_kv_caches``: one torch
        view per attention layer (a dict in layer order, or a list),
        ``[num_blocks, num_kv_heads, block_size, 2 * head_size]`` (MLA:
        ``[num_blocks, 1, block_size, head_size]``), each a strided view of one
        flat buffer in any of vLLM's six physical orders.

        ``kv_split`` says how the attention backend splits the last dimension:
        ``"last_dim"`` (FlashAttention, FlashInfer, Triton: K is
        ``[..., :head_size]``, V ``[..., head_size:]``) or ``"cpu"`` (vLLM's
        CPU backend, ISA ``vec`` / ``vec16``: each block's head tile
        ``[block_size, 2 * head_size]`` is K stored ``[head_size][block_size]``
        followed by V ``[block_size][head_size]``; LBHNC only).  ``block_tokens``
        is the manager block size (``cache_config.block_size``) when the
        kernel blocks are smaller.  ``head_start`` / ``model_kv_heads`` place a
        tensor-parallel rank's heads among the model's.  fp8 caches are uint8
        tensors in vLLM: pass ``dtype="fp8_e4m3"`` or ``"fp8_e5m2"``.
        """
        tensors = list(kv_caches.values()) if isinstance(kv_caches, Mapping) else list(kv_caches)
        if not tensors:
            raise InvalidArgument("no KV cache tensors")
        if not all(_is_tensor(t) for t in tensors):
            raise InvalidArgument("vLLM's KV caches are torch tensors")
        backend, device = _check_arrays(tensors)
        t0 = tensors[0]
        if t0.dim() != 4:
            raise ShapeError(f"a vLLM cache view is [blocks, heads, block_size, content], got "
                             f"{tuple(t0.shape)}")  # fmt: skip
        for i, t in enumerate(tensors):
            if tuple(t.shape) != tuple(t0.shape) or t.stride() != t0.stride():
                raise ShapeError(f"layer {i} is {tuple(t.shape)} / {t.stride()}, layer 0 is "
                                 f"{tuple(t0.shape)} / {t0.stride()}")  # fmt: skip
            if t.dtype != t0.dtype:
                raise DTypeError(f"layer {i} is {t.dtype}, layer 0 {t0.dtype}")
        dt = _torch_kv_dtype(t0, dtype)
        num_blocks, heads, block, content = (int(v) for v in t0.shape)
        isz = int(t0.element_size())
        sb, sh, sn, sc = _byte_strides(t0)
        if sc != isz:
            raise ShapeError("vLLM's content dimension must be innermost (stride 1)")
        if mla:
            if kv_split != "last_dim":
                raise LayoutError("an MLA cache has one latent per token: no K/V split")
            if heads != 1:
                raise ShapeError(f"an MLA cache has one latent 'head', got {heads}")
            head_dim = content
            offs, strides = [0], [ComponentStrides(sb, sn, sh, isz)]
        else:
            if content % 2:
                raise ShapeError(f"content dimension {content} is not 2 * head_size")
            head_dim = content // 2
            hb = head_dim * isz
            if kv_split == "last_dim":
                offs = [0, hb]
                strides = [ComponentStrides(sb, sn, sh, isz)] * 2
            elif kv_split == "cpu":
                if sn != content * isz:
                    raise ShapeError(
                        "vLLM's CPU backend needs each head's [block_size, 2 * head_size] tile "
                        "contiguous (layout LBHNC)"
                    )
                _refuse_amx(dt, block)
                offs = [0, block * hb]
                strides = [
                    ComponentStrides(sb, isz, sh, block * isz),  # K: [head_size][block_size]
                    ComponentStrides(sb, hb, sh, isz),  # V: [block_size][head_size]
                ]
            else:
                raise InvalidArgument(f"kv_split must be 'last_dim' or 'cpu', got {kv_split!r}")
        bases = [_data_ptr(t) for t in tensors]
        memory = _vllm_memory_key(kv_split if not mla else "mla", bases, sb, sh, sn)
        layout = KVLayout(
            num_layers=len(tensors),
            num_kv_heads=heads,
            head_dim=head_dim,
            dtype=dt,
            page_tokens=block,
            order=MemoryOrder.STRIDED,
            mla=mla,
            name=name,
            head_start=head_start,
            model_kv_heads=model_kv_heads,
            memory=memory,
        )
        cache = cls.__new__(cls)
        cache._init(
            layout=layout,
            ptrs=[[b + o for o in offs] for b in bases],
            strides=strides,
            num_pages=num_blocks,
            device=device,
            backend=backend,
            tensors=kv_caches,
            arrays=tensors,
            sources=[[(i, o) for o in offs] for i in range(len(tensors))],
            block_tokens=block_tokens,
        )
        return cache

    @classmethod
    def from_sglang(
        cls,
        k_buffers: Sequence[Any],
        v_buffers: Sequence[Any] | None,
        *,
        page_size: int,
        dtype: DType | str | None = None,
        head_start: int = 0,
        model_kv_heads: int | None = None,
        name: str = "",
    ) -> PagedKVCache:
        """SGLang's token pool (checked against 0.5.23): ``MHATokenToKVPool``'s
        per-layer ``k_buffer`` and ``v_buffer`` lists, ``[size + page_size,
        heads, head_dim]`` (NHD, token slots; page ``p`` is slots
        ``[p * page_size, (p + 1) * page_size)``) or ``[pages, heads,
        page_size, head_dim]`` (``SGLANG_USE_HND_KVCACHE``).  K and V may be
        separate allocations.  MLA (``MLATokenToKVPool``): its ``kv_buffer``
        list as ``k_buffers`` and ``v_buffers=None``.  Block tables are SGLang's
        page indices."""
        ks = list(k_buffers)
        vs = None if v_buffers is None else list(v_buffers)
        if not ks:
            raise InvalidArgument("no KV cache tensors")
        if vs is not None and len(vs) != len(ks):
            raise ShapeError(f"{len(ks)} K buffers but {len(vs)} V buffers")
        everything = ks + (vs or [])
        if not all(_is_tensor(t) for t in everything):
            raise InvalidArgument("SGLang's KV buffers are torch tensors")
        backend, device = _check_arrays(everything)
        t0 = ks[0]
        for i, t in enumerate(everything):
            if tuple(t.shape) != tuple(t0.shape) or t.stride() != t0.stride():
                raise ShapeError(f"buffer {i} is {tuple(t.shape)} / {t.stride()}, buffer 0 is "
                                 f"{tuple(t0.shape)} / {t0.stride()}")  # fmt: skip
            if t.dtype != t0.dtype:
                raise DTypeError(f"buffer {i} is {t.dtype}, buffer 0 {t0.dtype}")
        dt = _torch_kv_dtype(t0, dtype)
        if not isinstance(page_size, int) or isinstance(page_size, bool) or page_size <= 0:
            raise InvalidArgument(f"page_size must be a positive int, got {page_size!r}")
        isz = int(t0.element_size())
        st = _byte_strides(t0)
        if t0.dim() == 3:  # NHD token slots
            rows, heads, head_dim = (int(v) for v in t0.shape)
            num_pages = rows // page_size
            s = ComponentStrides(page_size * st[0], st[0], st[1], st[2])
            kind = "NHD"
        elif t0.dim() == 4:  # HND pages
            num_pages, heads, block, head_dim = (int(v) for v in t0.shape)
            if block != page_size:
                raise ShapeError(f"HND buffer pages hold {block} tokens, page_size is {page_size}")
            s = ComponentStrides(st[0], st[2], st[1], st[3])
            kind = "HND"
        else:
            raise ShapeError(f"an SGLang buffer is 3-D (NHD) or 4-D (HND), got {tuple(t0.shape)}")
        if s.elem != isz:
            raise ShapeError("SGLang's head_dim axis must be contiguous")
        mla = vs is None
        if mla and heads != 1:
            raise ShapeError(f"an MLA kv_buffer has one latent 'head', got {heads}")
        layout = KVLayout(
            num_layers=len(ks),
            num_kv_heads=heads,
            head_dim=head_dim,
            dtype=dt,
            page_tokens=page_size,
            order=MemoryOrder.STRIDED,
            mla=mla,
            name=name,
            head_start=head_start,
            model_kv_heads=model_kv_heads,
            memory=f"sglang-{kind}:page={s.page}:token={s.token}:head={s.head}",
        )
        L = len(ks)
        rows_of = [
            [_data_ptr(ks[i])] + ([] if vs is None else [_data_ptr(vs[i])]) for i in range(L)
        ]
        sources = [[(i, 0)] + ([] if vs is None else [(L + i, 0)]) for i in range(L)]
        cache = cls.__new__(cls)
        cache._init(
            layout=layout,
            ptrs=rows_of,
            strides=[s] * layout.num_components,
            num_pages=num_pages,
            device=device,
            backend=backend,
            tensors=(ks, vs),
            arrays=everything,
            sources=sources,
            block_tokens=None,
        )
        return cache

    @classmethod
    def from_strided(
        cls,
        layout: KVLayout,
        component_ptrs: Sequence[Sequence[int]],
        strides: Sequence[ComponentStrides | Sequence[int]],
        num_pages: int,
        *,
        device: str = "cpu",
        keepalive: Any = None,
        block_tokens: int | None = None,
    ) -> PagedKVCache:
        """A cache from raw addresses, as the C ABI takes it: for each layer,
        the base address of each component (``layout.num_components`` of
        them), and for each component its byte strides (page, token, head,
        element).  For pointer lists such as SGLang's ``KVArgs.kv_data_ptrs``
        (K of every layer, then V; ``kv_item_lens`` is the page stride).  The
        memory must stay valid while the cache is used (``keepalive`` holds a
        reference for you)."""
        if not isinstance(layout, KVLayout):
            raise InvalidArgument(f"layout must be a KVLayout, got {type(layout).__name__}")
        comps = layout.num_components
        rows = [list(r) for r in component_ptrs]
        if len(rows) != layout.num_layers or any(len(r) != comps for r in rows):
            raise ShapeError(
                f"component_ptrs must be {layout.num_layers} layers x {comps} components"
            )
        strd = [s if isinstance(s, ComponentStrides) else ComponentStrides(*s) for s in strides]
        if len(strd) != comps:
            raise ShapeError(f"strides must give {comps} components")
        if device != "cpu" and not str(device).startswith("cuda:"):
            raise InvalidArgument(f"caches live on the CPU or a CUDA device, not {device}")
        num_pages = operator.index(num_pages)
        if num_pages < 0:
            raise InvalidArgument(f"num_pages must be >= 0, got {num_pages}")
        cache = cls.__new__(cls)
        cache._init(
            layout=layout,
            ptrs=[[operator.index(p) for p in r] for r in rows],
            strides=strd,
            num_pages=num_pages,
            device=str(device),
            backend="pointers",
            tensors=keepalive,
            arrays=[],
            sources=None,
            block_tokens=block_tokens,
        )
        return cache

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
        """Pages (kernel blocks) in each layer."""
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
        """``"numpy"``, ``"torch"``, or ``"pointers"`` (:meth:`from_strided`)."""
        return self._backend

    @property
    def tensors(self) -> Any:
        """What the cache was built from (the stacked array or the list; vLLM's
        dict or list; SGLang's ``(k_buffers, v_buffers)``)."""
        return self._tensors

    @property
    def component_ptrs(self) -> tuple[tuple[int, ...], ...]:
        """Base address of each component (K, V; or the latent) of each layer:
        the bytes of (page p, slot s, head h, element e) of component c of
        layer l start at ``component_ptrs[l][c] + p*page + s*token + h*head +
        e*elem`` (``strides[c]``)."""
        return self._component_ptrs

    @property
    def strides(self) -> tuple[ComponentStrides, ...]:
        """Byte strides of each component."""
        return self._strides

    @property
    def layer_ptrs(self) -> tuple[int, ...]:
        """Address of each layer's first component."""
        return tuple(row[0] for row in self._component_ptrs)

    @property
    def layer_nbytes(self) -> int:
        """Bytes of one layer's memory (kvbridge's own shapes: the layer
        tensor's size)."""
        if self._layout.order is not MemoryOrder.STRIDED:
            return self._layout.layer_numel(self._num_pages) * self._layout.itemsize
        return max(self._extent(c) for c in range(self._layout.num_components))

    @property
    def block_tokens(self) -> int:
        """Tokens covered by one block-table entry."""
        return self._block_tokens

    @property
    def block_ratio(self) -> int:
        """Kernel pages per block-table entry (``block_tokens / page_tokens``)."""
        return self._block_ratio

    def _extent(self, c: int) -> int:
        if self._num_pages == 0:
            return 0
        s, lay = self._strides[c], self._layout
        return (
            lay.itemsize
            + (self._num_pages - 1) * s.page
            + (lay.page_tokens - 1) * s.token
            + (lay.num_kv_heads - 1) * s.head
            + (lay.head_dim - 1) * s.elem
        )

    def layer_views(self) -> list[Any]:
        """One array per layer: views into a stacked array (no copies); the
        per-layer tensors as given; for other engines' caches, the tensors
        they were built from (vLLM: one per layer; SGLang: K then V)."""
        if self._stacked:
            return [self._arrays[0][i] for i in range(self._layout.num_layers)]
        return list(self._arrays)

    def component_view(self, layer: int, component: int) -> Any:
        """A torch uint8 view ``[pages, page_tokens, heads, head_dim,
        itemsize]`` of one component of one layer, sharing the cache's memory
        (the plain-torch reference and tests index it)."""
        if self._sources is None:
            raise Unavailable("a cache built from raw pointers has no tensors to view")
        import torch

        idx, off = self._sources[layer][component]
        src = self._arrays[idx]
        t = src if _is_tensor(src) else torch.from_numpy(src)
        storage = t.untyped_storage()
        flat = torch.empty(0, dtype=torch.uint8, device=t.device)
        flat.set_(storage, 0, (storage.nbytes(),), (1,))
        lay, s = self._layout, self._strides[component]
        return torch.as_strided(
            flat,
            (self._num_pages, lay.page_tokens, lay.num_kv_heads, lay.head_dim, lay.itemsize),
            (s.page, s.token, s.head, s.elem, 1),
            t.data_ptr() - storage.data_ptr() + off,
        )

    def range(
        self,
        block_table: Any,
        start: int,
        end: int,
        *,
        layers: tuple[int, int] | None = None,
        heads: tuple[int, int] | None = None,
        writable: bool = True,
    ) -> KVRange:
        """The validated range of one transfer (see :class:`KVRange`)."""
        return KVRange(self, block_table, start, end, layers=layers, heads=heads, writable=writable)

    def _kernel_table(
        self, table: np.ndarray[Any, np.dtype[np.int32]], start: int, end: int
    ) -> np.ndarray[Any, np.dtype[np.int32]]:
        """A block table in block_tokens units as a table of kernel pages."""
        r = self._block_ratio
        if r == 1 or end == start:
            return table
        bt = self._block_tokens
        first, last = start // bt, (end - 1) // bt
        if table.size <= last:
            raise PageIndexError(
                f"block table has {table.size} entries; tokens [{start}, {end}) with "
                f"{bt}-token blocks need {last + 1}"
            )
        cov = table[first : last + 1].astype(np.int64)
        blocks = self._num_pages // r
        if cov.size and (int(cov.min()) < 0 or int(cov.max()) >= blocks):
            raise PageIndexError(
                f"block table entries {first}..{last} name blocks outside the cache's {blocks} "
                f"{bt}-token blocks"
            )
        out = np.zeros((last + 1) * r, dtype=np.int32)
        out[first * r :] = (cov[:, None] * r + np.arange(r, dtype=np.int64)).reshape(-1)
        return out

    def __repr__(self) -> str:
        return (
            f"PagedKVCache({self._layout.describe()}; {self._num_pages} pages on "
            f"{self._device}, {self._backend})"
        )


class KVRange:
    """One transfer's range of a cache, checked once: tokens ``[start, end)``,
    ``layers`` (default all), the model's KV heads ``heads`` (default all the
    cache holds) and the block table (in ``cache.block_tokens`` units).

    ``writable=False`` makes a range that only packs, and that accepts a page
    named twice.  The block table is converted to int32 kernel pages and
    copied once (for a CUDA cache, staged to the device once); later changes to
    the caller's table do not affect the range.  Safe to use from several
    threads at once.
    """

    def __init__(
        self,
        cache: PagedKVCache,
        block_table: Any,
        start: int,
        end: int,
        *,
        layers: tuple[int, int] | None = None,
        heads: tuple[int, int] | None = None,
        writable: bool = True,
    ) -> None:
        core = _require_core()
        a = _RangeArgs(cache, block_table, start, end, layers, heads)
        rc, msg, plan = core.make_plan(
            cache._desc, a.table, a.start, a.end, *a.layers, *a.core_heads, writable
        )
        raise_for_status(rc, msg)
        self._cache = cache
        self._plan = plan
        self.start, self.end = a.start, a.end
        self.layers = a.layers
        self.heads = a.heads
        self.writable = bool(writable)
        self.nbytes: int = int(plan.nbytes)

    @property
    def cache(self) -> PagedKVCache:
        return self._cache

    @property
    def layout(self) -> KVLayout:
        return self._cache.layout

    @property
    def num_tokens(self) -> int:
        return self.end - self.start

    def pack(
        self,
        out: Any = None,
        *,
        offset: int = 0,
        nbytes: int | None = None,
        num_threads: int = 0,
        stream: Any = None,
        checksum: bool = False,
    ) -> Any:
        """Gather bytes ``[offset, offset + nbytes)`` of the range's wire buffer
        into ``out``; return ``out`` (``(out, xxh3)`` with ``checksum=True``).

        With ``out=None`` a uint8 buffer of the cache's backend and device is
        allocated; otherwise the first ``nbytes`` bytes of ``out`` are written.
        ``nbytes`` defaults to the rest of the wire buffer.  ``checksum=True``
        (CPU caches) also computes the XXH3-64 (seed 0) of the bytes written,
        in the same pass (one thread copies the slice then).  CUDA caches run
        on ``stream`` (None: torch's current stream; an int handle or a torch
        stream).
        """
        core = _require_core()
        cache = self._cache
        off, n = _slice(self.nbytes, offset, nbytes)
        threads = _threads(num_threads)
        handle = _stream(cache, stream)
        if checksum and cache.is_cuda:
            raise Unavailable("the checksum in the copy is computed on the CPU path only")
        if out is None:
            out = _new_buffer(cache, n)
        view = _as_bytes(out, writable=True, cache=cache, what="out")
        if _nbytes(view) < n:
            raise BufferTooSmall(f"out holds {_nbytes(view)} bytes; the slice needs {n}")
        rc, msg, digest = core.plan_pack(self._plan, off, view, n, threads, handle, bool(checksum))
        raise_for_status(rc, msg)
        return (out, int(digest)) if checksum else out

    def unpack(
        self,
        src: Any,
        *,
        offset: int = 0,
        nbytes: int | None = None,
        num_threads: int = 0,
        stream: Any = None,
        expect_checksum: int | None = None,
    ) -> None:
        """Scatter ``src`` -- bytes ``[offset, offset + nbytes)`` of the range's
        wire buffer -- into the cache.

        ``nbytes`` defaults to all of ``src``: a chunk of the wire buffer is
        unpacked by passing it with its offset, in any order.  On an argument
        error nothing is written.  ``expect_checksum`` (CPU caches): the
        XXH3-64 the bytes must have, verified in the same pass; on a mismatch
        :class:`~kvbridge.errors.ChecksumError` is raised and the cache slots
        of exactly this slice hold unspecified bytes (nothing else was
        written): unpacking the right bytes into the slice again repairs them.
        """
        core = _require_core()
        cache = self._cache
        if not self.writable:
            raise InvalidArgument("this range was made with writable=False: it only packs")
        view = _as_bytes(src, writable=False, cache=cache, what="src")
        have = _nbytes(view)
        if nbytes is not None and _index(nbytes, "nbytes") > have:
            raise BufferTooSmall(f"src holds {have} bytes; nbytes={nbytes}")
        off, n = _slice(self.nbytes, offset, have if nbytes is None else nbytes)
        threads = _threads(num_threads)
        handle = _stream(cache, stream)
        expect = None
        if expect_checksum is not None:
            if cache.is_cuda:
                raise Unavailable("the checksum in the copy is verified on the CPU path only")
            expect = _index(expect_checksum, "expect_checksum")
            if not 0 <= expect < 2**64:
                raise InvalidArgument(f"expect_checksum {expect} is not a u64")
        rc, msg = core.plan_unpack(self._plan, off, view, n, threads, handle, expect)
        raise_for_status(rc, msg)

    def __repr__(self) -> str:
        return (
            f"KVRange(tokens [{self.start}, {self.end}), layers {list(self.layers)}, heads "
            f"{list(self.heads)}, {self.nbytes} wire bytes of {self._cache!r})"
        )


class _RangeArgs:
    """A range's arguments checked and converted for the core (head range
    relative to the cache's heads, 0, 0 for all; kernel-page int32 table)."""

    def __init__(
        self,
        cache: PagedKVCache,
        block_table: Any,
        start: int,
        end: int,
        layers: tuple[int, int] | None,
        heads: tuple[int, int] | None,
    ) -> None:
        if not isinstance(cache, PagedKVCache):
            raise InvalidArgument(f"cache must be a PagedKVCache, got {type(cache).__name__}")
        lay = cache.layout
        self.start, self.end = _token_range(start, end)
        self.layers = lay.layer_range(layers)
        self.heads = lay.check_heads(heads)
        h0, h1 = self.heads
        self.core_heads = (
            (0, 0) if self.heads == lay.head_range else (h0 - lay.head_start, h1 - lay.head_start)
        )
        self.table = cache._kernel_table(_block_table(block_table), self.start, self.end)


# ---- construction helpers ------------------------------------------------------------
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


def _pages_from_shape(layout: KVLayout, shape: tuple[int, ...]) -> int:
    if len(shape) != len(layout.layer_shape(1)):
        raise ShapeError(f"layer shape {shape} has the wrong rank for {layout.layer_shape(1)}")
    axis = 0 if layout.mla or layout.order is MemoryOrder.PAGE_FIRST else 1
    return int(shape[axis])


def _native_strides(
    layout: KVLayout, s: tuple[int, ...], num_pages: int
) -> tuple[int, ComponentStrides]:
    """(component stride, strides) of a layer tensor of ``layout.layer_shape``."""
    if layout.mla:  # [P, pt, D]
        return 0, ComponentStrides(page=s[0], token=s[1], head=layout.head_bytes, elem=s[2])
    hnd = layout.head_order is HeadOrder.HND
    if layout.order is MemoryOrder.KV_FIRST:  # [2, P, pt, H, D] or [2, P, H, pt, D]
        comp, page, rest = s[0], s[1], s[2:]
    else:  # [P, 2, pt, H, D] or [P, 2, H, pt, D]
        page, comp, rest = s[0], s[1], s[2:]
    token, head = (rest[1], rest[0]) if hnd else (rest[0], rest[1])
    return comp, ComponentStrides(page=page, token=token, head=head, elem=rest[2])


_VLLM_ORDERS = {"LBNHC", "LBHNC", "LHBNC", "BLNHC", "BLHNC", "BHLNC"}


def _vllm_memory_key(split: str, bases: list[int], sb: int, sh: int, sn: int) -> str:
    """Names a vLLM cache's arrangement: the physical order of its axes (one
    of vLLM's KVCacheLayout names when it is one) and the strides that a
    byte-for-byte copy between two caches depends on."""
    steps = {b - a for a, b in itertools.pairwise(bases)}
    layer_step = steps.pop() if len(steps) == 1 and bases[1] > bases[0] else None
    axes = [("B", sb), ("H", sh), ("N", sn)]
    # Layers in their own regions (or one layer) are outermost.
    order = "".join(
        n
        for n, _ in sorted(axes + ([("L", layer_step)] if layer_step else []), key=lambda a: -a[1])
    )
    if layer_step is None or layer_step > max(sb, sh, sn):
        order = "L" + order.replace("L", "")
    order += "C"
    key = f"vllm-{split}:{order if order in _VLLM_ORDERS else 'custom'}:B={sb}:H={sh}:N={sn}"
    if order[0] == "B" and layer_step is not None:
        key += f":L={layer_step}"
    return key


# ---- argument plumbing ------------------------------------------------------------
def _refuse_amx(dt: DType, block: int) -> None:
    torch = _torch()
    amx = getattr(getattr(torch, "cpu", None), "_is_amx_tile_supported", None)
    if dt is DType.BF16 and block % 32 == 0 and amx is not None and bool(amx()):
        raise Unavailable(
            "on this CPU vLLM's CPU backend stores bf16 caches with 32-token blocks in "
            "AMX tiles, which kvbridge does not describe"
        )


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
    if cache.is_cuda:
        raise InvalidArgument("a CUDA cache built from pointers needs an `out` buffer")
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


# ---- one call, one range --------------------------------------------------------------
def wire_nbytes(
    layout: KVLayout,
    start: int,
    end: int,
    layers: tuple[int, int] | None = None,
    heads: tuple[int, int] | None = None,
) -> int:
    """Bytes of the wire buffer of tokens ``[start, end)``, a layer range and a
    head range (the model's heads, default all the layout's cache holds)."""
    s, e = _token_range(start, end)
    return layout.wire_nbytes(e - s, layers, heads)


def xxh3_64(data: Any) -> int:
    """XXH3-64 (seed 0) of a host buffer's bytes, computed by the pack core:
    equal to ``xxhash.xxh3_64_intdigest`` of the same bytes."""
    core = _require_core()
    arr: Any
    if isinstance(data, (bytes, bytearray, memoryview)):
        arr = np.frombuffer(data, dtype=np.uint8)
    elif isinstance(data, np.ndarray):
        arr = data.reshape(-1).view(np.uint8) if data.flags.c_contiguous else None
    elif _is_tensor(data) and _device_of(data) == "cpu" and data.is_contiguous():
        arr = data.detach().reshape(-1).view(_torch().uint8).numpy()
    else:
        arr = None
    if arr is None:
        raise InvalidArgument("xxh3_64 takes a contiguous host buffer")
    return int(core.xxh3_64(arr))


def pack(
    cache: PagedKVCache,
    block_table: Any,
    start: int,
    end: int,
    *,
    layers: tuple[int, int] | None = None,
    heads: tuple[int, int] | None = None,
    out: Any = None,
    offset: int = 0,
    nbytes: int | None = None,
    num_threads: int = 0,
    stream: Any = None,
    checksum: bool = False,
) -> Any:
    """Gather bytes ``[offset, offset + nbytes)`` of the wire buffer of tokens
    ``[start, end)`` (and ``layers``, ``heads``, default all) into ``out``;
    return ``out`` (``(out, xxh3)`` with ``checksum=True``).

    One call checks the range and packs (``cache.range(...).pack(...)``): to
    pack a transfer in chunks, make its :class:`KVRange` once instead.
    ``block_table[i]`` is the block holding tokens ``[i*bt, (i+1)*bt)``
    (``bt = cache.block_tokens``).  See :meth:`KVRange.pack` for the rest.
    """
    if not isinstance(cache, PagedKVCache):
        raise InvalidArgument(f"cache must be a PagedKVCache, got {type(cache).__name__}")
    if cache.is_cuda:  # one call: stage in stream order instead of making a plan
        return _once_cuda(
            True, cache, block_table, start, end, layers, heads, out, offset, nbytes,
            num_threads, stream, checksum,
        )  # fmt: skip
    rng = KVRange(cache, block_table, start, end, layers=layers, heads=heads, writable=False)
    return rng.pack(
        out, offset=offset, nbytes=nbytes, num_threads=num_threads, stream=stream, checksum=checksum
    )


def unpack(
    cache: PagedKVCache,
    block_table: Any,
    start: int,
    end: int,
    src: Any,
    *,
    layers: tuple[int, int] | None = None,
    heads: tuple[int, int] | None = None,
    offset: int = 0,
    nbytes: int | None = None,
    num_threads: int = 0,
    stream: Any = None,
    expect_checksum: int | None = None,
) -> None:
    """Scatter ``src`` -- bytes ``[offset, offset + nbytes)`` of the wire buffer
    of tokens ``[start, end)`` (and ``layers``, ``heads``) -- into the cache.

    One call checks the range and unpacks (``cache.range(...).unpack(...)``).
    See :meth:`KVRange.unpack`.
    """
    if not isinstance(cache, PagedKVCache):
        raise InvalidArgument(f"cache must be a PagedKVCache, got {type(cache).__name__}")
    if cache.is_cuda:
        _once_cuda(
            False, cache, block_table, start, end, layers, heads, src, offset, nbytes,
            num_threads, stream, expect_checksum is not None,
        )  # fmt: skip
        return
    rng = KVRange(cache, block_table, start, end, layers=layers, heads=heads, writable=True)
    rng.unpack(
        src,
        offset=offset,
        nbytes=nbytes,
        num_threads=num_threads,
        stream=stream,
        expect_checksum=expect_checksum,
    )


def _once_cuda(
    packing: bool,
    cache: PagedKVCache,
    block_table: Any,
    start: int,
    end: int,
    layers: tuple[int, int] | None,
    heads: tuple[int, int] | None,
    buf: Any,
    offset: int,
    nbytes: int | None,
    num_threads: int,
    stream: Any,
    checksum: bool,
) -> Any:
    """One pack or unpack of a CUDA cache through the per-call entry points,
    which stage the block table in stream order (a KVRange stages it once)."""
    core = _require_core()
    a = _RangeArgs(cache, block_table, start, end, layers, heads)
    total = cache.layout.wire_nbytes(a.end - a.start, a.layers, a.heads)
    if checksum:
        raise Unavailable("the checksum in the copy is computed on the CPU path only")
    threads = _threads(num_threads)
    if packing:
        off, n = _slice(total, offset, nbytes)
        handle = _stream(cache, stream)
        out = _new_buffer(cache, n) if buf is None else buf
        view = _as_bytes(out, writable=True, cache=cache, what="out")
        if _nbytes(view) < n:
            raise BufferTooSmall(f"out holds {_nbytes(view)} bytes; the slice needs {n}")
        rc, msg = core.pack(cache._desc, a.table, a.start, a.end, *a.layers, off, view, n,
                            threads, handle, *a.core_heads)  # fmt: skip
        raise_for_status(rc, msg)
        return out
    view = _as_bytes(buf, writable=False, cache=cache, what="src")
    have = _nbytes(view)
    if nbytes is not None and _index(nbytes, "nbytes") > have:
        raise BufferTooSmall(f"src holds {have} bytes; nbytes={nbytes}")
    off, n = _slice(total, offset, have if nbytes is None else nbytes)
    handle = _stream(cache, stream)
    rc, msg = core.unpack(cache._desc, a.table, a.start, a.end, *a.layers, off, view, n,
                          threads, handle, *a.core_heads)  # fmt: skip
    raise_for_status(rc, msg)
    return None
