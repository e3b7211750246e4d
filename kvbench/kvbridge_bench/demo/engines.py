"""The demo's engines: the reference decoder with the real model (or the
random one), a page source shared with a radix cache across threads, the
prefill's prefix-cached prefill, and the reference streams that every
pipeline's output is checked against."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import math
import os
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvbridge.cache.allocator import PageAllocator
from kvbridge.cache.radix import InsertResult, Pin, RadixCache
from kvbridge.errors import Cancelled
from kvbridge.handoff.params import SamplingParams
from kvbridge.handoff.sampling import index_seed, sample
from kvbridge.layout import KVLayout

from ..reference.decoder import ReferenceDecoder
from .config import DemoConfig

__all__ = [
    "CachePages",
    "LockedPages",
    "Prefilled",
    "PrefixPrefill",
    "cached_reference_streams",
    "make_engine",
    "reference_key",
    "reference_streams",
    "sample_margin",
    "verify_streams",
]

_WEIGHTS: dict[str, Any] = {}


def make_engine(
    cfg: DemoConfig, layout: KVLayout, num_pages: int, allocator: Any = None
) -> ReferenceDecoder:
    """The reference decoder with the configured weights (memory-mapped and
    shared by every engine of a process)."""
    if cfg.model == "random":
        return ReferenceDecoder(cfg.decoder_config(), layout, num_pages, allocator=allocator)
    if cfg.model_dir not in _WEIGHTS:
        from ..reference.model_file import load_model

        _WEIGHTS[cfg.model_dir] = load_model(Path(cfg.model_dir)).weights
    return ReferenceDecoder(
        cfg.decoder_config(),
        layout,
        num_pages,
        allocator=allocator,
        weights=_WEIGHTS[cfg.model_dir],
    )


class CachePages:
    """An engine's page source shared with a radix cache (and its prefix
    negotiation) on another thread: every call holds ``lock``; allocation
    evicts cached prefixes when the pool runs dry."""

    def __init__(self, radix: RadixCache, allocator: PageAllocator, lock: threading.Lock) -> None:
        self.radix, self.allocator, self.lock = radix, allocator, lock

    def alloc(self, n: int) -> list[int]:
        with self.lock:
            return list(self.radix.allocate(n))

    def free(self, pages: Sequence[int]) -> None:
        with self.lock:
            self.allocator.free(list(pages))


class LockedPages:
    """A page allocator that the event loop and the engine's worker thread
    may both call (the loop does an engine's bookkeeping: allocate, adopt,
    append_cached; the worker grows requests as they decode)."""

    def __init__(self, allocator: PageAllocator) -> None:
        self.allocator = allocator
        self.lock = threading.Lock()

    def alloc(self, n: int) -> list[int]:
        with self.lock:
            return self.allocator.alloc(n)

    def free(self, pages: Sequence[int]) -> None:
        with self.lock:
            self.allocator.free(list(pages))


@dataclass
class Prefilled:
    first_token: int
    block_table: list[int]
    hit_tokens: int  # prompt tokens whose KV came from the prefix cache
    computed: int  # tokens computed
    seconds: float  # compute time
    insert: InsertResult | None
    logits: torch.Tensor | None = None  # after the last prompt token


class PrefixPrefill:
    """Prefill with a prefix cache (the prefill side's radix tree over its own
    pages): a prefix computed before is not computed again.  The methods run
    on the engine's worker thread; the tree is shared under ``lock``."""

    def __init__(self, engine: ReferenceDecoder, radix: RadixCache, lock: threading.Lock) -> None:
        self.engine, self.radix, self.lock = engine, radix, lock

    def cached_tokens(self, prompt: Sequence[int]) -> int:
        """How much of ``prompt`` the cache holds now (an estimate: it may change)."""
        with self.lock:
            n = self.radix.lookup(list(prompt)).num_tokens
        return min(n, max(len(prompt) - 1, 0))

    def prefill(self, rid: int, prompt: Sequence[int], params: SamplingParams | None) -> Prefilled:
        """Compute ``prompt`` (less its cached prefix) into request ``rid``,
        cache its full pages (pinned until :meth:`release`) and sample token 0."""
        eng, pt = self.engine, self.radix.page_tokens
        with self.lock:
            m = self.radix.lookup(list(prompt))
            pin: Pin = self.radix.pin(m)
        # at least the last token is computed: its logits give token 0
        use = min(m.num_tokens, (len(prompt) - 1) // pt * pt)
        try:
            eng.allocate(rid)
            if use:
                eng.adopt(rid, prompt[:use], m.pages[: use // pt])
            t0 = time.perf_counter()
            logits = eng.forward({rid: list(prompt[use:])}, last_only=True)[rid][-1]
            secs = time.perf_counter() - t0
            first = sample(logits, params, 0) if params is not None else -1
            bt = eng.block_table(rid)
            with self.lock:
                ins = self.radix.insert(list(prompt), bt, pin=True)
                self.radix.release(pin)
        except BaseException:
            with self.lock:
                if pin.active:
                    self.radix.release(pin)
            eng.free(rid)
            raise
        eng.give_pages(rid, len(prompt) // pt)  # the cache owns the full pages now
        return Prefilled(first, bt, use, len(prompt) - use, secs, ins, logits)

    def warm(self, prompts: Sequence[Sequence[int]]) -> list[Pin]:
        """Compute ``prompts`` (the system prompts a long-running prefill has
        seen before) into the cache and keep them there: returns their pins."""
        pins: list[Pin] = []
        for i, prompt in enumerate(prompts):
            done = self.prefill(-(i + 1) * 7919, prompt, None)
            ins = done.insert
            if ins is not None and ins.pages:
                with self.lock:
                    pins.append(self.radix.pin(self.radix.lookup(list(prompt))))
            self.release(-(i + 1) * 7919, done)
        return pins

    def forget(self, pins: Sequence[Pin]) -> None:
        """Everything cached goes, except what ``pins`` hold."""
        with self.lock:
            self.radix.evict(self.radix.cached_pages)

    def release(self, rid: int, done: Prefilled) -> None:
        """The KV has been sent: unpin the cached pages, free the rest."""
        self.engine.free(rid)
        ins = done.insert
        if ins is not None:
            with self.lock:
                if ins.duplicates:
                    self.radix.allocator.free(ins.duplicates)  # type: ignore[union-attr]
                if ins.pin is not None and ins.pin.active:
                    self.radix.release(ins.pin)


# ---- the reference streams -------------------------------------------------------------
def sample_margin(logits: torch.Tensor, params: SamplingParams, index: int) -> tuple[int, float]:
    """:func:`sample` and the gap between the winning score and the runner-up
    (logits / temperature plus the index's Gumbel noise; the logits for
    greedy).  A gap near 0 is a near tie: two computations of the logits that
    differ by floating-point rounding may pick different tokens there."""
    tok = sample(logits, params, index)
    x = logits.detach().to("cpu", torch.float64)
    if not params.greedy:
        x = x / params.temperature
        if params.top_k and params.top_k < x.numel():
            kth = torch.topk(x, params.top_k).values[-1]
            x = x.masked_fill(x < kth, -math.inf)
        g = torch.Generator(device="cpu").manual_seed(index_seed(params.seed, index))
        u = torch.rand(x.numel(), generator=g, dtype=torch.float64).clamp_(1e-300, 1.0)
        x = x - torch.log(-torch.log(u))
    top = torch.topk(x, 2).values
    return tok, float(top[0] - top[1])


def reference_streams(
    cfg: DemoConfig,
    requests: Sequence[tuple[int, Sequence[int], SamplingParams]],
    *,
    batch: int = 16,
    stop: threading.Event | None = None,
) -> dict[int, tuple[list[int], list[float]]]:
    """What one decoder outputs for each request by itself (prefix-cached
    prefill, decode steps batched across requests, which computing each
    alone equals up to rounding), with each position's sampling margin.
    ``stop`` set: raise :class:`Cancelled` at the next step."""
    lay = cfg.p_layout()
    # room for a whole batch without any prefix shared (the cache evicts the rest)
    need = sorted((lay.pages_for(len(p) + pr.max_new_tokens) + 1 for _, p, pr in requests))
    pages = max(cfg.p_pages, 2 * sum(need[-batch:]) + 16)
    alloc = PageAllocator(pages)
    radix = RadixCache(lay.page_tokens, allocator=alloc)
    lock = threading.Lock()
    eng = make_engine(cfg, lay, pages, CachePages(radix, alloc, lock))
    pre = PrefixPrefill(eng, radix, lock)
    out: dict[int, tuple[list[int], list[float]]] = {}
    todo = list(requests)
    while todo:
        group, todo = todo[:batch], todo[batch:]
        live: dict[int, tuple[list[int], list[float], SamplingParams, Prefilled]] = {}
        for rid, prompt, params in group:
            done = pre.prefill(rid, prompt, None)
            assert done.logits is not None
            t, g = sample_margin(done.logits, params, 0)
            live[rid] = ([t], [g], params, done)
        running = {r for r, (toks, _, pr, _) in live.items() if not pr.is_last(0, toks[0])}
        while running:
            if stop is not None and stop.is_set():
                raise Cancelled("reference streams: stopped")
            step = eng.forward({r: [live[r][0][-1]] for r in running}, last_only=True)
            for r in list(running):
                toks, margins, params, _ = live[r]
                t, g = sample_margin(step[r][-1], params, len(toks))
                toks.append(t)
                margins.append(g)
                if params.is_last(len(toks) - 1, t):
                    running.discard(r)
        for r, (toks, margins, _, done) in live.items():
            pre.release(r, done)
            out[r] = (toks, margins)
    return out


REFS_FORMAT = 2  # 2: every request in one batch


def reference_key(
    cfg: DemoConfig, requests: Sequence[tuple[int, Sequence[int], SamplingParams]]
) -> str:
    """What the reference streams depend on: the weights (the prepared
    model's files), the KV dtype and layout, torch's version and every
    request's prompt and sampling parameters."""
    h = hashlib.blake2b(digest_size=16)
    meta: dict[str, Any] = {
        "format": REFS_FORMAT,
        "torch": torch.__version__,
        "model": cfg.model,
        "layout": cfg.p_layout().describe(),
    }
    if cfg.model == "random":
        meta["decoder"] = dataclasses.asdict(cfg.decoder_config())
    else:
        d = Path(cfg.model_dir)
        meta["files"] = sorted(
            (f.name, f.stat().st_size, int(f.stat().st_mtime)) for f in d.iterdir() if f.is_file()
        )
        meta["config"] = (d / "config.json").read_text()
    h.update(json.dumps(meta, sort_keys=True, default=str).encode())
    for rid, prompt, params in requests:
        h.update(json.dumps([rid, list(prompt), dataclasses.asdict(params)]).encode())
    return h.hexdigest()


def cached_reference_streams(
    cfg: DemoConfig,
    requests: Sequence[tuple[int, Sequence[int], SamplingParams]],
    cache_dir: Path | None,
    *,
    stop: threading.Event | None = None,
    threads: int | None = None,
) -> tuple[dict[int, tuple[list[int], list[float]]], bool]:
    """:func:`reference_streams`, kept in ``cache_dir`` under
    :func:`reference_key` (None: not kept); returns them and whether they
    came from the cache.  A file that does not parse is computed again.
    Computed in one batch, on ``threads`` torch threads."""
    path = None
    if cache_dir is not None:
        path = cache_dir / f"refs-{reference_key(cfg, requests)}.json"
        try:
            doc = json.loads(path.read_text())
            out = {int(k): (list(v[0]), list(v[1])) for k, v in doc.items()}
            if set(out) == {rid for rid, _, _ in requests}:
                return out, True
        except (OSError, ValueError, TypeError, IndexError):
            pass
    old_threads = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        out = reference_streams(cfg, requests, stop=stop, batch=max(1, len(requests)))
    finally:
        torch.set_num_threads(old_threads)
    if path is not None:
        with contextlib.suppress(OSError):
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".tmp{os.getpid()}")
            tmp.write_text(json.dumps({str(k): v for k, v in out.items()}))
            os.replace(tmp, path)
    return out, False


def _deficit(logits: torch.Tensor, params: SamplingParams, index: int, token: int) -> float:
    """How far ``token`` is from being what :func:`sample` draws at
    ``index`` from ``logits``: 0 when it is; otherwise the smallest change of
    the scores (logits / temperature) that would make it win, which is both
    its gap to the best score and, under top-k, its gap below the k-th
    logit.  A token that another computation of the same logits placed
    inside the top k while this one places it just outside (a tie at the
    k-th logit, one rounding step apart) gets that small gap, not an
    infinite one: the k-th boundary is a near tie like any other."""
    x = logits.detach().to("cpu", torch.float64)
    if params.greedy:
        return float(x.max() - x[token])
    x = x / params.temperature
    outside = 0.0
    if params.top_k and params.top_k < x.numel():
        kth = torch.topk(x, params.top_k).values[-1]
        outside = max(0.0, float(kth - x[token]))
        keep = x >= kth
        keep[token] = True
        x = x.masked_fill(~keep, -math.inf)
    g = torch.Generator(device="cpu").manual_seed(index_seed(params.seed, index))
    u = torch.rand(x.numel(), generator=g, dtype=torch.float64).clamp_(1e-300, 1.0)
    x = x - torch.log(-torch.log(u))
    return max(outside, float(x.max() - x[token]))


def verify_streams(
    cfg: DemoConfig,
    items: Sequence[tuple[int, Sequence[int], SamplingParams, Sequence[int]]],
) -> dict[int, float]:
    """For each ``(rid, prompt, params, output)``, teacher-force ``output``
    through the reference engine and return the largest deficit of an output
    token (:func:`_deficit`: its score's gap to what wins at its position; 0: every token is
    what the reference samples given the same prefix).  A stream that took
    another token at a near tie (floating-point rounding of two different
    computations) has a small deficit there and 0 elsewhere; wrong KV or a
    lost or repeated token gives large deficits."""
    lay = cfg.p_layout()
    longest = max((len(p) + len(o) for _, p, _, o in items), default=1)
    pages = max(cfg.p_pages, 4 * lay.pages_for(longest) + 4)
    # the prompts share their system prompts: a prefix cache computes them once
    alloc = PageAllocator(pages)
    radix = RadixCache(lay.page_tokens, allocator=alloc)
    lock = threading.Lock()
    eng = make_engine(cfg, lay, pages, CachePages(radix, alloc, lock))
    pre = PrefixPrefill(eng, radix, lock)
    out: dict[int, float] = {}
    for rid, prompt, params, output in items:
        done = pre.prefill(rid, prompt, None)
        try:
            assert done.logits is not None
            rows = [done.logits]
            if len(output) > 1:
                rows += list(eng.forward({rid: list(output[:-1])})[rid])
            worst = 0.0
            for i, (row, tok) in enumerate(zip(rows, output, strict=False)):
                worst = max(worst, _deficit(row, params, i, int(tok)))
            out[rid] = worst
        finally:
            pre.release(rid, done)
    return out
