"""KV-cache layouts: how one engine's paged KV cache sits in memory, and the
canonical wire layout that two engines with different layouts agree on.

A :class:`KVLayout` describes the cache of one engine: layers, KV heads, head
dim, dtype, tokens per page, memory order and whether it is MLA.  It knows the
byte strides of each axis, which is all the pack core needs.

The *wire layout* of a token range ``[start, end)``, a layer range
``[l0, l1)`` and a range of the model's KV heads ``[h0, h1)`` is independent of
page size and memory order::

    wire[layer - l0][component][token - start][head - h0][head_dim]   (C order)

``component`` is 0 for K and 1 for V (MLA caches have one component, the
latent vector).  Layers are outermost so that a layer-by-layer sender emits a
contiguous prefix of the buffer; a token is ``(h1 - h0) * head_dim`` elements,
so a sender with 16-token NHD pages and a receiver with 64-token HND pages move
the same bytes.  The wire of all the model's heads is the default; a cache of
one tensor-parallel rank holds a contiguous head range (``head_start``,
``num_kv_heads`` of ``model_kv_heads``) and moves sub-ranges of it.
"""

from __future__ import annotations

import enum
import functools
import hashlib
import operator
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .errors import LayoutError

__all__ = [
    "DType",
    "HeadOrder",
    "KVLayout",
    "MemoryOrder",
    "WireRange",
    "tp_head_range",
]


class DType(str, enum.Enum):
    """Element types of a KV cache.  The value is the canonical name."""

    FP32 = "fp32"
    FP16 = "fp16"
    BF16 = "bf16"
    FP8_E4M3 = "fp8_e4m3"
    FP8_E5M2 = "fp8_e5m2"

    @property
    def itemsize(self) -> int:
        return _ITEMSIZES[self._name_]  # by name: an Enum's .value is a slow descriptor

    @property
    def code(self) -> int:
        """Stable small integer used on the wire (docs/protocol.md)."""
        return _DTYPE_CODES[self]

    @classmethod
    def from_code(cls, code: int) -> DType:
        for k, v in _DTYPE_CODES.items():
            if v == code:
                return k
        raise LayoutError(f"unknown dtype code {code}")

    @classmethod
    def parse(cls, value: object) -> DType:
        """Accept a DType, a canonical name, a HF ``torch_dtype`` string, or a
        numpy/torch dtype object."""
        if isinstance(value, DType):
            return value
        name = str(value).lower().replace("torch.", "")
        aliases = {
            "float32": "fp32",
            "float": "fp32",
            "float16": "fp16",
            "half": "fp16",
            "bfloat16": "bf16",
            "float8_e4m3fn": "fp8_e4m3",
            "float8_e4m3": "fp8_e4m3",
            "fp8": "fp8_e4m3",
            "float8_e5m2": "fp8_e5m2",
        }
        name = aliases.get(name, name)
        try:
            return cls(name)
        except ValueError:
            raise LayoutError(f"unsupported KV dtype {value!r}") from None


_ITEMSIZES = {"FP32": 4, "FP16": 2, "BF16": 2, "FP8_E4M3": 1, "FP8_E5M2": 1}

_DTYPE_CODES = {
    DType.FP32: 1,
    DType.FP16: 2,
    DType.BF16: 3,
    DType.FP8_E4M3: 4,
    DType.FP8_E5M2: 5,
}


class MemoryOrder(str, enum.Enum):
    """How a cache's tensors are shaped.

    ``KV_FIRST`` is ``[2, pages, page_tokens, heads, dim]`` per layer (K/V
    outermost, as vLLM's v0 and early v1 caches were); ``PAGE_FIRST`` is
    FlashInfer's ``[pages, 2, page_tokens, heads, dim]``.  ``STRIDED`` means
    the memory is described by the engine's own tensors, not by the layout: a
    :class:`kvbridge.pack.PagedKVCache` built with ``from_vllm``,
    ``from_sglang`` or ``from_strided`` derives every byte stride from them,
    and the layout's ``memory`` key names the arrangement (docs/layouts.md).
    """

    KV_FIRST = "kv_first"
    PAGE_FIRST = "page_first"
    STRIDED = "strided"

    @classmethod
    def parse(cls, value: object) -> MemoryOrder:
        if isinstance(value, MemoryOrder):
            return value
        name = {"flashinfer": "page_first"}.get(str(value), str(value))
        if name == "vllm":
            raise LayoutError(
                "'vllm' is not a memory order: vLLM's caches (0.26 and later) are strided views "
                "of one buffer; describe them with PagedKVCache.from_vllm (docs/layouts.md)"
            )
        try:
            return cls(name)
        except ValueError:
            raise LayoutError(f"unknown memory order {value!r}") from None


class HeadOrder(str, enum.Enum):
    """Inside a page: ``NHD`` is ``[page_tokens, heads, dim]``, ``HND`` is
    ``[heads, page_tokens, dim]``."""

    NHD = "NHD"
    HND = "HND"

    @classmethod
    def parse(cls, value: object) -> HeadOrder:
        if isinstance(value, HeadOrder):
            return value
        try:
            return cls(str(value).upper())
        except ValueError:
            raise LayoutError(f"unknown head order {value!r}") from None


@dataclass(frozen=True)
class KVLayout:
    """One engine's paged KV cache.

    The cache is either one tensor per layer (``stacked=False``), each of
    :meth:`layer_shape`, or one tensor of :meth:`cache_shape` with the layer
    axis first (``stacked=True``).  MLA caches (``mla=True``) hold one latent
    vector of ``head_dim`` elements per token and layer (``num_kv_heads`` is
    1, and there is no K/V axis): their per-layer shape is
    ``[pages, page_tokens, head_dim]`` whatever the memory order.

    ``num_kv_heads`` is the number of KV heads the cache holds (its tensors'
    head axis).  A tensor-parallel rank holds the model's heads
    ``[head_start, head_start + num_kv_heads)`` of ``model_kv_heads``
    (default: all of them, ``head_start`` 0).  ``order=STRIDED`` layouts
    (an engine's own tensors) carry a ``memory`` key instead of shapes.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: DType = DType.FP16
    page_tokens: int = 16
    order: MemoryOrder = MemoryOrder.KV_FIRST
    head_order: HeadOrder = HeadOrder.NHD
    stacked: bool = False
    mla: bool = False
    name: str = field(default="", compare=False)
    head_start: int = 0
    model_kv_heads: int | None = None
    memory: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", DType.parse(self.dtype))
        object.__setattr__(self, "order", MemoryOrder.parse(self.order))
        object.__setattr__(self, "head_order", HeadOrder.parse(self.head_order))
        for attr in ("num_layers", "num_kv_heads", "head_dim", "page_tokens"):
            v = getattr(self, attr)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise LayoutError(f"{attr} must be a positive int, got {v!r}")
        if self.num_layers > 4096 or self.num_kv_heads > 4096 or self.head_dim > 65536:
            raise LayoutError("layout dimension out of supported range")
        if self.page_tokens > 1 << 20:
            raise LayoutError("page_tokens out of supported range")
        self._check_heads()
        if self.order is MemoryOrder.STRIDED:
            if not isinstance(self.memory, str) or not self.memory:
                raise LayoutError("a strided layout needs a memory key (PagedKVCache.from_*)")
            if self.stacked:
                raise LayoutError("a strided layout has per-layer views, not a stacked tensor")
        elif self.memory:
            raise LayoutError(f"a {self.order.value} layout has no memory key")
        if self.mla:
            if self.num_kv_heads != 1:
                raise LayoutError("an MLA layout has exactly one latent 'head' per token")
            if self.head_order is not HeadOrder.NHD:
                raise LayoutError("an MLA layout has no head axis to reorder (use NHD)")
            if self.total_kv_heads != 1:
                raise LayoutError("an MLA latent is not split across ranks (model_kv_heads 1)")

    def _check_heads(self) -> None:
        start, total = self.head_start, self.model_kv_heads
        if not isinstance(start, int) or isinstance(start, bool) or start < 0:
            raise LayoutError(f"head_start must be an int >= 0, got {start!r}")
        if total is None:
            if start != 0:
                raise LayoutError("a layout with head_start > 0 needs model_kv_heads")
            return
        if not isinstance(total, int) or isinstance(total, bool) or total <= 0 or total > 4096:
            raise LayoutError(f"model_kv_heads must be a positive int, got {total!r}")
        if start + self.num_kv_heads > total:
            raise LayoutError(
                f"heads [{start}, {start + self.num_kv_heads}) are outside the model's {total}"
            )
        if start == 0 and total == self.num_kv_heads:
            object.__setattr__(self, "model_kv_heads", None)  # all heads: the plain form

    # ---- heads -------------------------------------------------------------
    @property
    def total_kv_heads(self) -> int:
        """KV heads of the model (all ranks together)."""
        return self.model_kv_heads if self.model_kv_heads is not None else self.num_kv_heads

    @property
    def head_range(self) -> tuple[int, int]:
        """The model's heads ``[h0, h1)`` that this cache holds."""
        return (self.head_start, self.head_start + self.num_kv_heads)

    @property
    def holds_all_heads(self) -> bool:
        return self.model_kv_heads is None

    def check_heads(self, heads: tuple[int, int] | None) -> tuple[int, int]:
        """A validated head range ``[h0, h1)`` of the model's heads inside the
        cache's own (``None``: all the cache holds); a :class:`LayoutError` for
        a range outside the cache or empty."""
        if heads is None:
            return self.head_range
        try:
            h0, h1 = (operator.index(heads[0]), operator.index(heads[1]))
        except (TypeError, IndexError):
            raise LayoutError(f"heads must be a pair of ints, got {heads!r}") from None
        c0, c1 = self.head_range
        if isinstance(heads[0], bool) or isinstance(heads[1], bool) or not c0 <= h0 < h1 <= c1:
            raise LayoutError(
                f"head range {heads!r} is outside the cache's heads [{c0}, {c1}) (or empty)"
            )
        return (h0, h1)

    def wire_head_slice(
        self, heads: tuple[int, int], within: tuple[int, int] | None = None
    ) -> tuple[int, int, int]:
        """Where heads ``[h0, h1)`` sit in each row of the wire of the head range
        ``within`` (default all the model's heads): ``(offset, nbytes, row_bytes)``.
        A row is one token of one (layer, component), so the slice is ``nbytes``
        bytes at ``offset`` of every ``row_bytes``-byte row."""
        w0, w1 = within if within is not None else (0, self.total_kv_heads)
        if not 0 <= w0 < w1 <= self.total_kv_heads:
            raise LayoutError(f"head range {within!r} outside the model's {self.total_kv_heads}")
        h0, h1 = heads
        if not w0 <= h0 < h1 <= w1:
            raise LayoutError(f"head range {heads!r} is outside [{w0}, {w1}) (or empty)")
        hb = self.head_bytes
        return ((h0 - w0) * hb, (h1 - h0) * hb, (w1 - w0) * hb)

    # ---- sizes -----------------------------------------------------------
    @property
    def num_components(self) -> int:
        """2 (K and V), or 1 for MLA."""
        return 1 if self.mla else 2

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize

    @functools.cached_property
    def head_bytes(self) -> int:
        """Bytes of one head of one token: the unit that is always contiguous."""
        return self.head_dim * self.dtype.itemsize

    @property
    def token_bytes_per_layer(self) -> int:
        """Bytes of one token in one layer, all components and heads."""
        return self.num_components * self.num_kv_heads * self.head_bytes

    @property
    def bytes_per_token(self) -> int:
        """KV bytes of one token across all layers."""
        return self.num_layers * self.token_bytes_per_layer

    @property
    def bytes_per_page(self) -> int:
        """KV bytes of one page across all layers."""
        return self.page_tokens * self.bytes_per_token

    @property
    def page_bytes_per_layer(self) -> int:
        return self.page_tokens * self.token_bytes_per_layer

    # ---- shapes and strides --------------------------------------------------
    def _require_shaped(self) -> None:
        if self.order is MemoryOrder.STRIDED:
            raise LayoutError(
                "a strided layout has no shape of its own: its PagedKVCache holds the strides"
            )

    def layer_shape(self, num_pages: int) -> tuple[int, ...]:
        """Shape of one layer's tensor holding ``num_pages`` pages."""
        self._require_shaped()
        p, t, h, d, c = num_pages, self.page_tokens, self.num_kv_heads, self.head_dim, 2
        if self.mla:
            return (p, t, d)
        inner = (t, h, d) if self.head_order is HeadOrder.NHD else (h, t, d)
        if self.order is MemoryOrder.KV_FIRST:
            return (c, p, *inner)
        return (p, c, *inner)

    def cache_shape(self, num_pages: int) -> tuple[int, ...]:
        """Shape of the stacked tensor (layer axis first)."""
        return (self.num_layers, *self.layer_shape(num_pages))

    def layer_numel(self, num_pages: int) -> int:
        n = 1
        for s in self.layer_shape(num_pages):
            n *= s
        return n

    def byte_strides(self, num_pages: int) -> tuple[int, int, int, int]:
        """Byte strides (component, page, token-in-page, head) inside one
        layer's tensor.  The head_dim elements of a head are contiguous."""
        self._require_shaped()
        hb = self.head_bytes
        t, h, p = self.page_tokens, self.num_kv_heads, num_pages
        if self.mla:
            return (0, t * hb, hb, hb)
        if self.head_order is HeadOrder.NHD:
            s_tok, s_head, page_inner = h * hb, hb, t * h * hb
        else:
            s_tok, s_head, page_inner = hb, t * hb, t * h * hb
        if self.order is MemoryOrder.KV_FIRST:
            return (p * page_inner, page_inner, s_tok, s_head)
        return (page_inner, 2 * page_inner, s_tok, s_head)

    # ---- wire layout -----------------------------------------------------------
    def layer_range(self, layers: tuple[int, int] | None) -> tuple[int, int]:
        if layers is None:
            return (0, self.num_layers)
        l0, l1 = int(layers[0]), int(layers[1])
        if not 0 <= l0 <= l1 <= self.num_layers:
            raise LayoutError(f"layer range {layers!r} outside [0, {self.num_layers}]")
        return (l0, l1)

    def wire_nbytes(
        self,
        num_tokens: int,
        layers: tuple[int, int] | None = None,
        heads: tuple[int, int] | None = None,
    ) -> int:
        """Bytes of the wire layout for ``num_tokens`` tokens, a layer range and
        a head range of the cache's heads (default: all the cache holds)."""
        if num_tokens < 0:
            raise LayoutError(f"negative token count {num_tokens}")
        l0, l1 = self.layer_range(layers)
        h0, h1 = self.check_heads(heads)
        return (l1 - l0) * num_tokens * self.num_components * (h1 - h0) * self.head_bytes

    def wire_shape(
        self,
        num_tokens: int,
        layers: tuple[int, int] | None = None,
        heads: tuple[int, int] | None = None,
    ) -> tuple[int, ...]:
        """Element shape of the wire buffer: [layers, comps, tokens, heads, dim]."""
        l0, l1 = self.layer_range(layers)
        h0, h1 = self.check_heads(heads)
        return (l1 - l0, self.num_components, num_tokens, h1 - h0, self.head_dim)

    def pages_for(self, num_tokens: int) -> int:
        """Pages needed to hold ``num_tokens`` tokens starting at token 0."""
        return -(-num_tokens // self.page_tokens)

    # ---- compatibility ---------------------------------------------------------
    def wire_key(self) -> str:
        """What two peers must agree on to exchange wire buffers (the model's
        heads: ranks holding different head ranges of one model agree)."""
        return (
            f"kvbridge-wire-v1;L={self.num_layers};C={self.num_components};"
            f"H={self.total_kv_heads};D={self.head_dim};dtype={self.dtype.value}"
        )

    @functools.cached_property
    def compat_hash(self) -> int:
        """Stable 64-bit hash of the wire-relevant shape (model, dtype); equal
        for two layouts iff their wire buffers are interchangeable.  Page size,
        memory order and the head range a rank holds do not enter it: the wire
        layout hides them (a transfer names its head range itself)."""
        return _h64(self.wire_key())

    def transfer_hash(self, heads: tuple[int, int] | None = None) -> int:
        """The layout hash of a transfer of the model's heads ``[h0, h1)``
        (docs/protocol.md 7, "Head ranges"): ``compat_hash`` for all the
        model's heads, else the hash of ``wire_key()`` followed by
        ``;heads={h0}-{h1}``.  A TCP OPEN carries it, so a receiver refuses
        bytes of another head range than the one it expects."""
        total = self.total_kv_heads
        h0, h1 = (0, total) if heads is None else (int(heads[0]), int(heads[1]))
        if not 0 <= h0 < h1 <= total:
            raise LayoutError(f"head range {heads!r} outside the model's {total} KV heads")
        if (h0, h1) == (0, total):
            return self.compat_hash
        return _h64(f"{self.wire_key()};heads={h0}-{h1}")

    @property
    def exact_hash(self) -> int:
        """Stable 64-bit hash of the full memory layout; equal iff pages can be
        copied byte for byte (the zero-copy RDMA path needs this)."""
        key = (
            f"{self.wire_key()};pt={self.page_tokens};order={self.order.value};"
            f"heads={self.head_order.value};stacked={int(self.stacked)}"
        )
        if not self.holds_all_heads:
            key += f";head_range={self.head_range[0]}-{self.head_range[1]}"
        if self.memory:
            key += f";memory={self.memory}"
        return _h64(key)

    def same_memory_layout(self, other: KVLayout) -> bool:
        return self.exact_hash == other.exact_hash

    def check_wire_compatible(self, other: KVLayout) -> None:
        if self.compat_hash != other.compat_hash:
            raise LayoutError(
                f"layouts are not wire-compatible: {self.wire_key()} vs {other.wire_key()}"
            )

    def replace(self, **changes: Any) -> KVLayout:
        from dataclasses import replace

        return replace(self, **changes)

    # ---- model configs -----------------------------------------------------------
    @classmethod
    def from_hf_config(
        cls,
        config: Mapping[str, Any],
        *,
        page_tokens: int = 16,
        dtype: DType | str | None = None,
        order: MemoryOrder | str = MemoryOrder.KV_FIRST,
        head_order: HeadOrder | str = HeadOrder.NHD,
        stacked: bool = False,
        name: str = "",
        tp_size: int = 1,
        tp_rank: int = 0,
    ) -> KVLayout:
        """Build the layout of a model from its Hugging Face ``config.json``.

        Standard attention (Llama, Qwen2, Mistral, ...): ``num_key_value_heads``
        heads of ``head_dim`` (or ``hidden_size / num_attention_heads``).  MLA
        (DeepSeek-V2/V3: ``kv_lora_rank`` present): one latent of
        ``kv_lora_rank + qk_rope_head_dim`` elements per token and layer.

        ``tp_size`` / ``tp_rank``: the layout of one tensor-parallel rank, which
        holds a contiguous range of the KV heads as vLLM and SGLang split them:
        ``heads / tp_size`` heads from ``tp_rank * heads / tp_size``, or, with
        more ranks than heads, one head (head ``tp_rank // (tp_size / heads)``,
        replicated).  An MLA latent is whole on every rank.
        """
        if not (isinstance(tp_size, int) and isinstance(tp_rank, int) and 0 <= tp_rank < tp_size):
            raise LayoutError(f"bad tensor-parallel rank {tp_rank!r} of {tp_size!r}")
        try:
            layers = int(config["num_hidden_layers"])
            dt = DType.parse(dtype if dtype is not None else config.get("torch_dtype", "bf16"))
            if config.get("kv_lora_rank"):
                latent = int(config["kv_lora_rank"]) + int(config.get("qk_rope_head_dim", 0))
                return cls(
                    num_layers=layers,
                    num_kv_heads=1,
                    head_dim=latent,
                    dtype=dt,
                    page_tokens=page_tokens,
                    order=MemoryOrder.parse(order),
                    head_order=HeadOrder.NHD,
                    stacked=stacked,
                    mla=True,
                    name=name or str(config.get("_name_or_path", "")),
                )
            heads = int(config["num_attention_heads"])
            kv_heads = int(config.get("num_key_value_heads") or heads)
            head_dim = int(config.get("head_dim") or int(config["hidden_size"]) // heads)
        except (KeyError, TypeError, ValueError) as e:
            if isinstance(e, LayoutError):
                raise
            raise LayoutError(f"not a usable HF config: {e!r}") from e
        start, local = tp_head_range(kv_heads, tp_size, tp_rank)
        return cls(
            num_layers=layers,
            num_kv_heads=local,
            head_start=start,
            model_kv_heads=kv_heads,
            head_dim=head_dim,
            dtype=dt,
            page_tokens=page_tokens,
            order=MemoryOrder.parse(order),
            head_order=HeadOrder.parse(head_order),
            stacked=stacked,
            mla=False,
            name=name or str(config.get("_name_or_path", "")),
        )

    @classmethod
    def for_model(cls, model: str, **kwargs: Any) -> KVLayout:
        """Layout of a bundled model preset (see :mod:`kvbridge.models`)."""
        from .models import MODEL_CONFIGS

        try:
            cfg = MODEL_CONFIGS[model.lower()]
        except KeyError:
            raise LayoutError(
                f"unknown model preset {model!r}; known: {sorted(MODEL_CONFIGS)}"
            ) from None
        kwargs.setdefault("name", model.lower())
        return cls.from_hf_config(cfg, **kwargs)

    def describe(self) -> str:
        kind = "MLA latent" if self.mla else f"{self.num_kv_heads}x{self.head_dim}"
        if not self.holds_all_heads:
            h0, h1 = self.head_range
            kind += f" (heads [{h0}, {h1}) of {self.total_kv_heads})"
        order = (
            self.memory
            if self.order is MemoryOrder.STRIDED
            else f"{self.order.value}/{self.head_order.value}"
        )
        return (
            f"{self.name or 'layout'}: {self.num_layers} layers, {kind}, {self.dtype.value}, "
            f"{self.page_tokens}-token pages, {order}"
            f"{', stacked' if self.stacked else ''}; {self.bytes_per_token} B/token"
        )


@dataclass(frozen=True)
class WireRange:
    """A token range ``[start, end)`` and layer range ``[layer_start, layer_end)``
    of one request, as carried on the wire."""

    start: int
    end: int
    layer_start: int = 0
    layer_end: int = -1  # -1: all layers

    def resolve(self, layout: KVLayout) -> WireRange:
        le = layout.num_layers if self.layer_end < 0 else self.layer_end
        layout.layer_range((self.layer_start, le))
        if not 0 <= self.start <= self.end:
            raise LayoutError(f"bad token range [{self.start}, {self.end})")
        return WireRange(self.start, self.end, self.layer_start, le)

    @property
    def num_tokens(self) -> int:
        return self.end - self.start

    def nbytes(self, layout: KVLayout) -> int:
        r = self.resolve(layout)
        return layout.wire_nbytes(r.num_tokens, (r.layer_start, r.layer_end))


def tp_head_range(kv_heads: int, tp_size: int, tp_rank: int) -> tuple[int, int]:
    """(first head, number of heads) of the KV heads that tensor-parallel rank
    ``tp_rank`` of ``tp_size`` holds, as vLLM's ``QKVParallelLinear`` and
    SGLang split them: ``kv_heads / tp_size`` each, or one replicated head per
    rank when there are more ranks than heads."""
    if tp_size <= 0 or not 0 <= tp_rank < tp_size:
        raise LayoutError(f"bad tensor-parallel rank {tp_rank} of {tp_size}")
    if tp_size >= kv_heads:
        if tp_size % kv_heads:
            raise LayoutError(f"{tp_size} ranks do not replicate {kv_heads} KV heads evenly")
        return (tp_rank // (tp_size // kv_heads), 1)
    if kv_heads % tp_size:
        raise LayoutError(f"{kv_heads} KV heads do not split over {tp_size} ranks")
    per = kv_heads // tp_size
    return (tp_rank * per, per)


def _h64(key: str) -> int:
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little")
