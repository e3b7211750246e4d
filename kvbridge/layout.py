"""KV-cache layouts: how one engine's paged KV cache sits in memory, and the
canonical wire layout that two engines with different layouts agree on.

A :class:`KVLayout` describes the cache of one engine: layers, KV heads, head
dim, dtype, tokens per page, memory order and whether it is MLA.  It knows the
byte strides of each axis, which is all the pack core needs.

The *wire layout* of a token range ``[start, end)`` and a layer range
``[l0, l1)`` is independent of page size and memory order::

    wire[layer - l0][component][token - start][head][head_dim]   (C order)

``component`` is 0 for K and 1 for V (MLA caches have one component, the
latent vector).  Layers are outermost so that a layer-by-layer sender emits a
contiguous prefix of the buffer; a token is ``num_heads * head_dim`` elements,
so a sender with 16-token NHD pages and a receiver with 64-token HND pages move
the same bytes.
"""

from __future__ import annotations

import enum
import hashlib
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
        return {"fp32": 4, "fp16": 2, "bf16": 2}.get(self.value, 1)

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


_DTYPE_CODES = {
    DType.FP32: 1,
    DType.FP16: 2,
    DType.BF16: 3,
    DType.FP8_E4M3: 4,
    DType.FP8_E5M2: 5,
}


class MemoryOrder(str, enum.Enum):
    """Where the K/V component axis sits relative to the page axis.

    ``KV_FIRST`` is vLLM's ``[2, pages, page_tokens, heads, dim]``;
    ``PAGE_FIRST`` is FlashInfer's ``[pages, 2, page_tokens, heads, dim]``.
    """

    KV_FIRST = "kv_first"
    PAGE_FIRST = "page_first"

    @classmethod
    def parse(cls, value: object) -> MemoryOrder:
        if isinstance(value, MemoryOrder):
            return value
        name = {"vllm": "kv_first", "flashinfer": "page_first"}.get(str(value), str(value))
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
        if self.mla:
            if self.num_kv_heads != 1:
                raise LayoutError("an MLA layout has exactly one latent 'head' per token")
            if self.head_order is not HeadOrder.NHD:
                raise LayoutError("an MLA layout has no head axis to reorder (use NHD)")

    # ---- sizes -----------------------------------------------------------
    @property
    def num_components(self) -> int:
        """2 (K and V), or 1 for MLA."""
        return 1 if self.mla else 2

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize

    @property
    def head_bytes(self) -> int:
        """Bytes of one head of one token: the unit that is always contiguous."""
        return self.head_dim * self.itemsize

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
    def layer_shape(self, num_pages: int) -> tuple[int, ...]:
        """Shape of one layer's tensor holding ``num_pages`` pages."""
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

    def wire_nbytes(self, num_tokens: int, layers: tuple[int, int] | None = None) -> int:
        """Bytes of the wire layout for ``num_tokens`` tokens and a layer range."""
        if num_tokens < 0:
            raise LayoutError(f"negative token count {num_tokens}")
        l0, l1 = self.layer_range(layers)
        return (l1 - l0) * num_tokens * self.token_bytes_per_layer

    def wire_shape(self, num_tokens: int, layers: tuple[int, int] | None = None) -> tuple[int, ...]:
        """Element shape of the wire buffer: [layers, comps, tokens, heads, dim]."""
        l0, l1 = self.layer_range(layers)
        return (l1 - l0, self.num_components, num_tokens, self.num_kv_heads, self.head_dim)

    def pages_for(self, num_tokens: int) -> int:
        """Pages needed to hold ``num_tokens`` tokens starting at token 0."""
        return -(-num_tokens // self.page_tokens)

    # ---- compatibility ---------------------------------------------------------
    def wire_key(self) -> str:
        """What two peers must agree on to exchange wire buffers."""
        return (
            f"kvbridge-wire-v1;L={self.num_layers};C={self.num_components};"
            f"H={self.num_kv_heads};D={self.head_dim};dtype={self.dtype.value}"
        )

    @property
    def compat_hash(self) -> int:
        """Stable 64-bit hash of the wire-relevant shape (model, dtype); equal
        for two layouts iff their wire buffers are interchangeable.  Page size
        and memory order do not enter it: the wire layout hides them."""
        return _h64(self.wire_key())

    @property
    def exact_hash(self) -> int:
        """Stable 64-bit hash of the full memory layout; equal iff pages can be
        copied byte for byte (the zero-copy RDMA path needs this)."""
        key = (
            f"{self.wire_key()};pt={self.page_tokens};order={self.order.value};"
            f"heads={self.head_order.value};stacked={int(self.stacked)}"
        )
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
    ) -> KVLayout:
        """Build the layout of a model from its Hugging Face ``config.json``.

        Standard attention (Llama, Qwen2, Mistral, ...): ``num_key_value_heads``
        heads of ``head_dim`` (or ``hidden_size / num_attention_heads``).  MLA
        (DeepSeek-V2/V3: ``kv_lora_rank`` present): one latent of
        ``kv_lora_rank + qk_rope_head_dim`` elements per token and layer.
        """
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
        return cls(
            num_layers=layers,
            num_kv_heads=kv_heads,
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
        return (
            f"{self.name or 'layout'}: {self.num_layers} layers, {kind}, {self.dtype.value}, "
            f"{self.page_tokens}-token pages, {self.order.value}/{self.head_order.value}"
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


def _h64(key: str) -> int:
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little")
