"""Other engines' tensors as they are: vLLM's per-layer views and SGLang's K
and V buffers described as a PagedKVCache (docs/layouts.md has the rules and
the versions they were checked against)."""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from typing import Any

from ..errors import DTypeError, InvalidArgument, LayoutError, ShapeError, Unavailable
from ..layout import DType, KVLayout, MemoryOrder
from .cache import ComponentStrides, PagedKVCache
from .plumbing import _byte_strides, _check_arrays, _data_ptr, _is_tensor, _torch, _torch_kv_dtype


def describe_vllm(
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
    """:meth:`PagedKVCache.from_vllm` (its docstring says what it takes)."""
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
    if cpu_isa is not None and kv_split != "cpu":
        raise InvalidArgument("cpu_isa names a kernel set of vLLM's CPU backend (kv_split='cpu')")
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
            _check_cpu_isa(cpu_isa or vllm_cpu_isa(dt, block, head_dim), dt, block)
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
    cache = PagedKVCache.__new__(PagedKVCache)
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


def describe_sglang(
    k_buffers: Sequence[Any],
    v_buffers: Sequence[Any] | None,
    *,
    page_size: int,
    dtype: DType | str | None = None,
    head_start: int = 0,
    model_kv_heads: int | None = None,
    name: str = "",
) -> PagedKVCache:
    """:meth:`PagedKVCache.from_sglang` (its docstring says what it takes)."""
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
    rows_of = [[_data_ptr(ks[i])] + ([] if vs is None else [_data_ptr(vs[i])]) for i in range(L)]
    sources = [[(i, 0)] + ([] if vs is None else [(L + i, 0)]) for i in range(L)]
    cache = PagedKVCache.__new__(PagedKVCache)
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


CPU_ISAS = ("vec", "vec16", "amx")


def vllm_cpu_isa(dtype: DType, block_size: int, head_size: int) -> str:
    """The kernel set vLLM 0.32's CPU attention backend picks on this CPU
    (``_get_attn_isa`` in vllm/v1/attention/backends/cpu_attn.py, x86): AMX
    for bf16 caches with blocks a multiple of 32 where the CPU has AMX tiles
    (and vLLM's AVX-512 BF16 build, which has the AMX kernels, is loaded),
    else ``vec`` for blocks a multiple of 32 and ``vec16`` for the others."""
    if head_size % 32 and head_size % 16 == 0:
        return "vec16"
    if dtype is DType.BF16 and block_size % 32 == 0 and _has_amx_tiles():
        return "amx"
    return "vec" if block_size % 32 == 0 else "vec16"


def _has_amx_tiles() -> bool:
    cpu = getattr(_torch(), "cpu", None)
    amx = getattr(cpu, "_is_amx_tile_supported", None)
    bf16 = getattr(cpu, "_is_avx512_bf16_supported", None)
    return bool(amx is not None and amx() and (bf16 is None or bf16()))


def _check_cpu_isa(isa: str, dt: DType, block: int) -> None:
    if isa not in CPU_ISAS:
        raise InvalidArgument(f"cpu_isa must be one of {', '.join(CPU_ISAS)}, got {isa!r}")
    if isa == "amx":
        raise Unavailable(
            f"vLLM's CPU backend stores {dt.value} caches with {block}-token blocks in AMX "
            "tiles on this CPU (ISA 'amx'), which kvbridge does not describe; run vLLM with a "
            "block size that is not a multiple of 32 (e.g. 16: its 'vec16' kernels keep the "
            "layout kvbridge reads) or another KV dtype"
        )
