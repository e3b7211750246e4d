"""PagedKVCache: one engine's paged KV cache, its layout and its memory, and
ComponentStrides, the byte strides of one component."""

from __future__ import annotations

import operator
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import (
    InvalidArgument,
    LayoutError,
    PageIndexError,
    ShapeError,
    Unavailable,
    raise_for_status,
)
from ..layout import DType, HeadOrder, KVLayout, MemoryOrder
from .plumbing import (
    _NUMPY_DTYPES,
    _TORCH_DTYPES,
    _byte_strides,
    _check_arrays,
    _check_dtype,
    _core,
    _data_ptr,
    _is_tensor,
    aligned_empty,
)

if TYPE_CHECKING:
    from .range import KVRange


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
        cpu_isa: str | None = None,
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
        followed by V ``[block_size][head_size]``; LBHNC only).  ``cpu_isa``
        names the CPU backend's kernel set (``"vec"``, ``"vec16"``, ``"amx"``;
        None: the one vLLM 0.32 picks on this CPU for the dtype and block
        size): ``"amx"`` (bf16, blocks a multiple of 32, a CPU with AMX tiles)
        stores tiles kvbridge does not describe and raises ``Unavailable``.
        ``block_tokens``
        is the manager block size (``cache_config.block_size``) when the
        kernel blocks are smaller.  ``head_start`` / ``model_kv_heads`` place a
        tensor-parallel rank's heads among the model's.  fp8 caches are uint8
        tensors in vLLM: pass ``dtype="fp8_e4m3"`` or ``"fp8_e5m2"``.
        """
        from .engines import describe_vllm

        return describe_vllm(
            kv_caches,
            kv_split=kv_split,
            mla=mla,
            dtype=dtype,
            block_tokens=block_tokens,
            head_start=head_start,
            model_kv_heads=model_kv_heads,
            name=name,
            cpu_isa=cpu_isa,
        )

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
        from .engines import describe_sglang

        return describe_sglang(
            k_buffers,
            v_buffers,
            page_size=page_size,
            dtype=dtype,
            head_start=head_start,
            model_kv_heads=model_kv_heads,
            name=name,
        )

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
            # aligned as an engine's cache is (torch's allocator: 64 bytes)
            raw = aligned_empty(nbytes, zeroed=fill is None)
            if fill == "random":
                raw[:] = rng.integers(0, 256, size=nbytes, dtype=np.uint8)
            elif isinstance(fill, int) and 0 <= fill <= 255:
                raw[:] = fill
            elif fill is not None:
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

    def memory_spans(self) -> list[tuple[int, int]]:
        """The ``(start, end)`` address spans that hold the cache's bytes, every
        layer's components merged where they touch."""
        from .memory import merged_spans

        return merged_spans(
            [
                (ptr, ptr + self._extent(c))
                for row in self._component_ptrs
                for c, ptr in enumerate(row)
            ]
        )

    def memory_nbytes(self) -> int:
        """Bytes of the spans that hold the cache (:meth:`memory_spans`)."""
        return sum(b - a for a, b in self.memory_spans())

    def advise_huge_pages(self, *, collapse: bool = True) -> int:
        """Ask the kernel to back this host cache with 2 MiB pages
        (``madvise`` ``MADV_HUGEPAGE`` then ``MADV_COLLAPSE``, in place, the
        contents kept; see :mod:`kvbridge._pack.memory`); return the bytes of
        the cache that huge pages back afterwards.  An engine calls it once,
        after allocating its cache: torch allocates on 4 KiB pages where the
        system's THP mode is ``madvise``, and a gather of random blocks then
        pays a TLB miss per block (measured in docs/pack.md).  Raises
        :class:`~kvbridge.errors.Unavailable` for a CUDA cache or where the
        system has no transparent huge pages."""
        from .memory import advise_spans

        if self.is_cuda:
            raise Unavailable("huge pages are for host memory; this cache is on " + self._device)
        return advise_spans(self.memory_spans(), collapse=collapse)

    def huge_page_bytes(self) -> int:
        """Bytes of the cache that huge pages back now (``/proc/self/smaps``)."""
        from .memory import spans_huge_page_bytes

        return spans_huge_page_bytes(self.memory_spans())

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
        start: int | None = None,
        end: int | None = None,
        *,
        layers: tuple[int, int] | None = None,
        heads: tuple[int, int] | None = None,
        writable: bool = True,
    ) -> KVRange:
        """The validated range of one transfer (see :class:`KVRange`): of a
        :class:`~kvbridge.span.KVSpan`, or of the five values."""
        from .range import KVRange

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
