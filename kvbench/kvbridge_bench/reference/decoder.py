"""A small Llama-style decoder over a paged KV cache (the reference engine).

RMSNorm, rotary position embeddings, grouped-query attention and a SwiGLU MLP;
weights are drawn deterministically from a seed.  The KV cache is one tensor
per layer of ``KVLayout.layer_shape(num_pages)`` in any memory order, head
order and dtype the layout names (fp32, bf16, fp16), addressed through block
tables: ``block_table[i]`` is the page of tokens ``[i * page_tokens,
(i + 1) * page_tokens)``.

The cache is the only state of a request besides its token list: a decoder
can continue a request whose KV someone else wrote into its pages
(:meth:`ReferenceDecoder.append_cached`).  Every forward pass writes the new
tokens' K and V into the cache first and then attends over the cache, so an
extend of ``k`` tokens and ``k`` decode steps compute the same thing.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from kvbridge.cache.allocator import PageAllocator
from kvbridge.errors import DTypeError, InvalidArgument, LayoutError
from kvbridge.layout import DType, HeadOrder, KVLayout, MemoryOrder

from .kvio import component_views, gather_wire, scatter_wire, slot_index

__all__ = ["DecoderConfig", "ReferenceDecoder"]

_TORCH_DTYPES = {DType.FP32: torch.float32, DType.BF16: torch.bfloat16, DType.FP16: torch.float16}


@dataclass(frozen=True)
class DecoderConfig:
    """Model shape.  The defaults run a demo on 2 CPU cores; set real shapes
    (e.g. 32 layers, hidden 4096, 32 heads, 8 KV heads, head_dim 128) to
    mimic a real model's KV cache."""

    num_layers: int = 4
    hidden_size: int = 256
    num_heads: int = 8
    num_kv_heads: int = 2
    head_dim: int = 32
    intermediate_size: int = 512
    vocab_size: int = 512
    rope_theta: float = 10000.0
    rms_eps: float = 1e-5
    seed: int = 0

    def __post_init__(self) -> None:
        for name in (
            "num_layers",
            "hidden_size",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "intermediate_size",
            "vocab_size",
        ):
            if getattr(self, name) <= 0:
                raise InvalidArgument(f"{name} must be positive")
        if self.num_heads % self.num_kv_heads:
            raise InvalidArgument("num_heads must be a multiple of num_kv_heads")
        if self.head_dim % 2:
            raise InvalidArgument("head_dim must be even (rotary embeddings)")

    def kv_layout(
        self,
        *,
        dtype: DType | str = DType.FP32,
        page_tokens: int = 16,
        order: MemoryOrder | str = MemoryOrder.KV_FIRST,
        head_order: HeadOrder | str = HeadOrder.NHD,
    ) -> KVLayout:
        """The KV layout of this model with the given cache format."""
        return KVLayout(
            num_layers=self.num_layers,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            dtype=DType.parse(dtype),
            page_tokens=page_tokens,
            order=MemoryOrder.parse(order),
            head_order=HeadOrder.parse(head_order),
            name="reference",
        )


@dataclass
class _Request:
    tokens: list[int] = field(default_factory=list)  # tokens whose KV is in the cache
    block_table: list[int] = field(default_factory=list)
    external: int = 0  # leading pages owned by the caller (see ReferenceDecoder.adopt)


@dataclass
class _Layer:
    attn_norm: torch.Tensor
    wq: torch.Tensor
    wk: torch.Tensor
    wv: torch.Tensor
    wo: torch.Tensor
    mlp_norm: torch.Tensor
    w_gate: torch.Tensor
    w_up: torch.Tensor
    w_down: torch.Tensor


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


class ReferenceDecoder:
    """The reference implementation of :class:`kvbridge.handoff.engine.Engine`."""

    def __init__(
        self,
        config: DecoderConfig,
        layout: KVLayout,
        num_pages: int,
        *,
        device: str | torch.device = "cpu",
        weight_dtype: torch.dtype = torch.float32,
        allocator: PageAllocator | None = None,
        weights: Mapping[str, torch.Tensor] | None = None,
    ) -> None:
        if layout.mla or layout.stacked:
            raise LayoutError("the reference decoder needs a per-layer K/V layout (not MLA)")
        if (layout.num_layers, layout.num_kv_heads, layout.head_dim) != (
            config.num_layers,
            config.num_kv_heads,
            config.head_dim,
        ):
            raise LayoutError(f"layout {layout.describe()} does not fit the model {config}")
        if layout.dtype not in _TORCH_DTYPES:
            raise DTypeError(f"the reference decoder cannot store a {layout.dtype.value} cache")
        self.config = config
        self.layout = layout
        self.device = torch.device(device)
        self.dtype = weight_dtype if weights is None else weights["embed"].dtype
        # An engine with a prefix cache shares one allocator with it
        # (kvbridge.cache.RadixCache); anything with alloc(n) / free(pages).
        self.num_pages = num_pages
        self.allocator: Any = allocator if allocator is not None else PageAllocator(num_pages)
        self.kv_cache: list[torch.Tensor] = [
            torch.zeros(
                layout.layer_shape(num_pages), dtype=_TORCH_DTYPES[layout.dtype], device=self.device
            )
            for _ in range(layout.num_layers)
        ]
        self._requests: dict[int, _Request] = {}
        if weights is None:
            self._init_weights()
        else:
            self._load_weights(weights)
        c = config
        self._inv_freq = 1.0 / (
            c.rope_theta ** (torch.arange(0, c.head_dim, 2, dtype=torch.float64) / c.head_dim)
        )

    # ---- weights -------------------------------------------------------------
    def _init_weights(self) -> None:
        c = self.config
        g = torch.Generator(device="cpu").manual_seed(c.seed)

        def w(fan_in: int, *shape: int, scale: float = 1.0) -> torch.Tensor:
            t = torch.randn(*shape, generator=g) * (scale / math.sqrt(fan_in))
            return t.to(self.device, self.dtype)

        def norm(n: int) -> torch.Tensor:
            return (1.0 + 0.1 * torch.randn(n, generator=g)).to(self.device, self.dtype)

        h, qd, kd, i = (
            c.hidden_size,
            c.num_heads * c.head_dim,
            c.num_kv_heads * c.head_dim,
            c.intermediate_size,
        )
        self.embed = w(1, c.vocab_size, h)
        self.layers = [
            _Layer(
                attn_norm=norm(h),
                wq=w(h, h, qd),
                wk=w(h, h, kd),
                wv=w(h, h, kd),
                wo=w(qd, qd, h),
                mlp_norm=norm(h),
                w_gate=w(h, h, i),
                w_up=w(h, h, i),
                w_down=w(i, i, h),
            )
            for _ in range(c.num_layers)
        ]
        self.final_norm = norm(h)
        self.lm_head = w(h, h, c.vocab_size, scale=4.0)

    def _load_weights(self, weights: Mapping[str, torch.Tensor]) -> None:
        """Real weights (``kvbridge_bench.reference.model_file``): ``embed [vocab,
        hidden]``, ``layers.{i}.{attn_norm, wq, wk, wv, wo, mlp_norm, w_gate,
        w_up, w_down}`` as ``[in, out]``, ``final_norm``, ``lm_head [hidden,
        vocab]``; used as given (no copy on the decoder's device)."""
        c = self.config
        h, qd, kd, i = (
            c.hidden_size,
            c.num_heads * c.head_dim,
            c.num_kv_heads * c.head_dim,
            c.intermediate_size,
        )
        shapes = {"attn_norm": (h,), "wq": (h, qd), "wk": (h, kd), "wv": (h, kd)}
        shapes |= {"wo": (qd, h), "mlp_norm": (h,), "w_gate": (h, i), "w_up": (h, i)}
        shapes["w_down"] = (i, h)

        def get(name: str, shape: tuple[int, ...]) -> torch.Tensor:
            t = weights.get(name)
            if t is None:
                raise LayoutError(f"weights lack {name!r}")
            if tuple(t.shape) != shape:
                raise LayoutError(f"weight {name!r} has shape {tuple(t.shape)}, want {shape}")
            return t.to(self.device, self.dtype)

        self.embed = get("embed", (c.vocab_size, h))
        self.layers = [
            _Layer(**{k: get(f"layers.{li}.{k}", shp) for k, shp in shapes.items()})
            for li in range(c.num_layers)
        ]
        self.final_norm = get("final_norm", (h,))
        self.lm_head = get("lm_head", (h, c.vocab_size))

    def _rope(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """Rotate ``x`` [n, heads, dim] by positions ``pos`` [n] (half-split pairs)."""
        ang = pos.to(torch.float64)[:, None] * self._inv_freq[None, :]
        cos = torch.cos(ang).float().to(x.device)[:, None, :]
        sin = torch.sin(ang).float().to(x.device)[:, None, :]
        half = x.shape[-1] // 2
        xf = x.float()
        x1, x2 = xf[..., :half], xf[..., half:]
        return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).to(x.dtype)

    # ---- requests --------------------------------------------------------------
    def allocate(self, request_id: int) -> None:
        if request_id in self._requests:
            raise InvalidArgument(f"request {request_id} already allocated")
        self._requests[request_id] = _Request()

    def free(self, request_id: int) -> None:
        """Forget a request and free the pages it allocated itself (pages
        given to :meth:`adopt` stay with their owner)."""
        req = self._requests.pop(request_id, None)
        if req is not None:
            self.allocator.free(req.block_table[req.external :])

    def adopt(self, request_id: int, token_ids: Sequence[int], block_table: Sequence[int]) -> None:
        """Start an allocated, empty request from ``token_ids`` whose KV is
        already in the pages ``block_table`` (owned by the caller, e.g. a
        prefix cache); later tokens go to pages the decoder allocates."""
        req = self._req(request_id)
        if req.tokens or req.block_table:
            raise InvalidArgument(f"request {request_id} is not empty")
        self._check_tokens(token_ids)
        if len(block_table) < self.layout.pages_for(len(token_ids)):
            raise InvalidArgument(f"{len(block_table)} pages cannot hold {len(token_ids)} tokens")
        req.block_table.extend(int(p) for p in block_table)
        req.external = len(req.block_table)
        req.tokens.extend(int(t) for t in token_ids)

    def give_pages(self, request_id: int, n_pages: int) -> None:
        """The request's first ``n_pages`` pages now belong to the caller (a
        prefix cache adopted them): :meth:`free` leaves them alone."""
        req = self._req(request_id)
        if not 0 <= n_pages <= len(req.block_table):
            raise InvalidArgument(
                f"request {request_id} has {len(req.block_table)} pages, not {n_pages}"
            )
        req.external = max(req.external, n_pages)

    def has_request(self, request_id: int) -> bool:
        return request_id in self._requests

    def num_tokens(self, request_id: int) -> int:
        return len(self._req(request_id).tokens)

    def tokens(self, request_id: int) -> list[int]:
        return list(self._req(request_id).tokens)

    def block_table(self, request_id: int) -> list[int]:
        return list(self._req(request_id).block_table)

    def _req(self, request_id: int) -> _Request:
        try:
            return self._requests[request_id]
        except KeyError:
            raise InvalidArgument(f"unknown request {request_id}") from None

    def _grow(self, req: _Request, new_len: int) -> None:
        need = self.layout.pages_for(new_len) - len(req.block_table)
        if need > 0:
            req.block_table.extend(self.allocator.alloc(need))

    def append_cached(self, request_id: int, token_ids: Sequence[int]) -> list[int]:
        """Append tokens whose KV the caller writes into the request's pages
        (KV received from a prefill); returns the whole block table."""
        req = self._req(request_id)
        self._check_tokens(token_ids)
        self._grow(req, len(req.tokens) + len(token_ids))
        req.tokens.extend(int(t) for t in token_ids)
        return list(req.block_table)

    def read_kv(self, request_id: int, start: int, end: int) -> torch.Tensor:
        """The KV of tokens ``[start, end)`` in the wire layout."""
        req = self._req(request_id)
        if end > len(req.tokens):
            raise InvalidArgument(f"request {request_id} holds {len(req.tokens)} tokens, not {end}")
        return gather_wire(self.layout, self.kv_cache, req.block_table, start, end)

    def write_kv(self, request_id: int, start: int, wire: torch.Tensor) -> None:
        """Write wire-layout KV for tokens ``[start, start + n)`` (already appended)."""
        req = self._req(request_id)
        if start + wire.shape[2] > len(req.tokens):
            raise InvalidArgument("write_kv beyond the request's tokens; append_cached first")
        scatter_wire(self.layout, self.kv_cache, req.block_table, start, wire.to(self.device))

    def _check_tokens(self, token_ids: Sequence[int]) -> None:
        v = self.config.vocab_size
        for t in token_ids:
            if not 0 <= int(t) < v:
                raise InvalidArgument(f"token id {t} outside the vocabulary [0, {v})")

    # ---- forward ---------------------------------------------------------------
    def prefill(self, batch: Mapping[int, Sequence[int]]) -> dict[int, torch.Tensor]:
        """Run the prompts of new (empty) requests; logits of each last token."""
        for rid in batch:
            if self._req(rid).tokens:
                raise InvalidArgument(f"request {rid} is not empty; use extend")
        return {rid: out[-1] for rid, out in self.forward(batch, last_only=True).items()}

    def decode(self, batch: Mapping[int, int]) -> dict[int, torch.Tensor]:
        """One decode step: one token per request; the logits after each."""
        fed = {r: [t] for r, t in batch.items()}
        return {rid: out[0] for rid, out in self.forward(fed, last_only=True).items()}

    def extend(self, request_id: int, token_ids: Sequence[int]) -> torch.Tensor:
        """Append ``token_ids`` in one forward pass; logits ``[n, vocab]`` of each."""
        return self.forward({request_id: token_ids})[request_id]

    @torch.inference_mode()
    def forward(
        self, batch: Mapping[int, Sequence[int]], *, last_only: bool = False
    ) -> dict[int, torch.Tensor]:
        """Append tokens to several requests in one pass; logits of every new
        token (``[n, vocab]``), or with ``last_only`` of the last one (``[1, vocab]``)."""
        segs: list[tuple[int, _Request, int, int]] = []  # rid, req, first position, count
        flat: list[int] = []
        for rid, toks in batch.items():
            req = self._req(rid)
            toks = [int(t) for t in toks]
            if not toks:
                raise InvalidArgument(f"no tokens for request {rid}")
            self._check_tokens(toks)
            segs.append((rid, req, len(req.tokens), len(toks)))
            flat.extend(toks)
        grown: list[tuple[_Request, int]] = []
        try:
            for _, req, p0, n in segs:
                grown.append((req, len(req.block_table)))
                self._grow(req, p0 + n)
        except Exception:
            for req, before in grown:
                self.allocator.free(req.block_table[before:])
                del req.block_table[before:]
            raise
        c = self.config
        cd = self.dtype  # the matmuls run in the weights' dtype, the residual in fp32
        pos = torch.cat([torch.arange(p0, p0 + n) for _, _, p0, n in segs])
        x = self.embed[torch.as_tensor(flat, device=self.device)].float()
        num_pages = self.num_pages
        slots = [
            slot_index(self.layout, r.block_table, p0, p0 + n, num_pages) for _, r, p0, n in segs
        ]
        pt = self.layout.page_tokens
        ctx = [
            torch.as_tensor(r.block_table[: -(-(p0 + n) // pt)], dtype=torch.long)
            for _, r, p0, n in segs
        ]
        masks = [
            None
            if n == 1
            else (
                torch.arange(p0 + n, device=self.device)[None, :]
                <= torch.arange(p0, p0 + n, device=self.device)[:, None]
            )
            for _, _, p0, n in segs
        ]
        kvh, hd = c.num_kv_heads, c.head_dim
        group = c.num_heads // kvh
        scale = 1.0 / math.sqrt(c.head_dim)
        for li, layer in enumerate(self.layers):
            h = _rms_norm(x, layer.attn_norm, c.rms_eps).to(cd)
            q = self._rope((h @ layer.wq).view(-1, c.num_heads, hd), pos)
            k = self._rope((h @ layer.wk).view(-1, kvh, hd), pos)
            v = (h @ layer.wv).view(-1, kvh, hd)
            kc, vc = component_views(self.layout, self.kv_cache[li])
            outs = []
            off = 0
            for (_, _, p0, n), (pg, sl), pages, mask in zip(segs, slots, ctx, masks, strict=True):
                kc[pg, sl] = k[off : off + n].to(kc.dtype)
                vc[pg, sl] = v[off : off + n].to(vc.dtype)
                t = p0 + n
                # whole pages of the context, then its first t tokens: [kv heads, t, D]
                keys = kc.index_select(0, pages).reshape(-1, kvh, hd)[:t].permute(1, 2, 0)
                vals = vc.index_select(0, pages).reshape(-1, kvh, hd)[:t].transpose(0, 1)
                # queries grouped by the KV head they share: [kv heads, group * n, D]
                qs = q[off : off + n].view(n, kvh, group, hd).permute(1, 2, 0, 3)
                qs = qs.reshape(kvh, group * n, hd).float()
                scores = (qs @ keys.float()) * scale  # [kv heads, group * n, t]
                if mask is not None:
                    scores = scores.view(kvh, group, n, t).masked_fill(~mask, -math.inf)
                    scores = scores.view(kvh, group * n, t)
                att = torch.softmax(scores, dim=-1) @ vals.float()  # [kv heads, group * n, D]
                att = att.view(kvh, group, n, hd).permute(2, 0, 1, 3).reshape(n, -1)
                outs.append(att.to(cd))
                off += n
            x = x + (torch.cat(outs) @ layer.wo).float()
            h = _rms_norm(x, layer.mlp_norm, c.rms_eps).to(cd)
            mlp = (torch.nn.functional.silu(h @ layer.w_gate) * (h @ layer.w_up)) @ layer.w_down
            x = x + mlp.float()
        if last_only:
            ends = []
            off = 0
            for _, _, _, n in segs:
                off += n
                ends.append(off - 1)
            x = x[torch.as_tensor(ends, device=self.device)]
        logits = (_rms_norm(x, self.final_norm, c.rms_eps).to(cd) @ self.lm_head).float()
        result: dict[int, torch.Tensor] = {}
        off = 0
        for i, ((rid, req, _, n), toks) in enumerate(zip(segs, batch.values(), strict=True)):
            req.tokens.extend(int(t) for t in toks)
            result[rid] = logits[i : i + 1] if last_only else logits[off : off + n]
            off += n
        return result
