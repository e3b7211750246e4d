"""vLLM's CPU KV cache as kvbridge describes it, checked against vLLM's own
cache kernel: K and V written by ``cpu_attn_reshape_and_cache`` into a cache
of one block size, moved by kvbridge's pack/unpack into a cache of another,
equal byte for byte what the same kernel writes there directly.

Needs vLLM (``make test-vllm``); the check runs in a child process so that
vLLM's import-time warnings stay out of this suite's warning filters.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

REQUIRE = os.environ.get("KVBRIDGE_REQUIRE_VLLM") == "1"
if importlib.util.find_spec("vllm") is None:
    if REQUIRE:
        raise RuntimeError("KVBRIDGE_REQUIRE_VLLM=1 but vLLM is not installed here")
    pytest.skip("vLLM is not installed (make test-vllm runs these tests)", allow_module_level=True)

pytestmark = pytest.mark.timeout(300)

CHECK = r"""
import sys, numpy as np, torch
import vllm._custom_ops as ops
from vllm.v1.attention.backends.cpu_attn import _get_attn_isa
from kvbridge.errors import Unavailable
from kvbridge.integrations.vllm.cache import describe_vllm_cache
from kvbridge.layout import DType
from kvbridge.pack import PagedKVCache
from kvbridge._pack.engines import vllm_cpu_isa

H, D, L = 3, 64, 2
torch.manual_seed(0)

# kvbridge's default ISA is vLLM's own choice on this CPU
KV = {torch.float32: DType.FP32, torch.bfloat16: DType.BF16, torch.float16: DType.FP16}
for dt in KV:
    for bs in (16, 32, 48, 64, 128):
        for hd in (64, 80, 128):
            assert vllm_cpu_isa(KV[dt], bs, hd) == _get_attn_isa(dt, bs, hd), (dt, bs, hd)
print("isa rule agrees", flush=True)

def views(blocks, bs, dtype):
    flat = torch.zeros(L * blocks * H * bs * 2 * D, dtype=dtype)
    v = flat.view(L, blocks, H, bs, 2 * D)  # vLLM CPU: LBHNC, one flat buffer
    return [v[i] for i in range(L)]

def isa_of(bs):
    return "vec" if bs % 32 == 0 else "vec16"

def write(layers, bs, table, toks, k, v):
    for li, kv in enumerate(layers):
        c = kv.view(kv.shape[0], H, bs * 2, -1)
        kc, vc = c.chunk(2, dim=2)  # as CPUAttentionBackendImpl.do_kv_cache_update
        slots = torch.tensor([table[t // bs] * bs + t % bs for t in toks], dtype=torch.int64)
        ops.cpu_attn_reshape_and_cache(k[li][toks].contiguous(), v[li][toks].contiguous(),
                                       kc, vc, slots, isa_of(bs))

def describe(layers, bs):
    # the connector's own describer where vLLM keeps the vec layout; where it
    # would use AMX tiles that describer refuses, and the vec layout is
    # described by name (the kernel above wrote it)
    if _get_attn_isa(layers[0].dtype, bs, D) == "amx":
        try:
            describe_vllm_cache(layers, bs)
        except Unavailable:
            return PagedKVCache.from_vllm(layers, kv_split="cpu", cpu_isa=isa_of(bs))
        raise AssertionError("an AMX cache was described")
    return describe_vllm_cache(layers, bs)[0]

for dtype in (torch.float32, torch.bfloat16):
    n = 100
    k = torch.randn(L, n, H, D).to(dtype)
    v = torch.randn(L, n, H, D).to(dtype)
    for (sb, db) in ((32, 64), (64, 32), (32, 32), (16, 48)):
        src = views(16, sb, dtype)
        stab = list(range(15, 15 - (n + sb - 1) // sb, -1))
        write(src, sb, stab, list(range(n)), k, v)
        dtab = [3, 6, 1, 4, 0, 2, 5][: (n + db - 1) // db]
        for (s, e) in ((0, 100), (64, 100), (70, 99), (0, 5), (33, 65)):
            dst, ref = views(8, db, dtype), views(8, db, dtype)
            write(ref, db, dtab, list(range(s, e)), k, v)
            sc, dc = describe(src, sb), describe(dst, db)
            buf = sc.range(np.array(stab, np.int32), s, e, writable=False).pack()
            dc.range(np.array(dtab, np.int32), s, e).unpack(buf)
            ok = all(torch.equal(a, b) for a, b in zip(dst, ref))
            print(str(dtype), sb, db, s, e, "equal" if ok else "DIFFERENT", flush=True)
"""


def test_cpu_cache_matches_vllms_own_kernel() -> None:
    res = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, timeout=240)
    assert res.returncode == 0, res.stderr[-3000:]
    lines = [ln for ln in res.stdout.splitlines() if ln.endswith(("equal", "DIFFERENT"))]
    assert "isa rule agrees" in res.stdout
    assert len(lines) == 2 * 4 * 5, res.stdout
    assert all(ln.endswith(" equal") for ln in lines), "\n".join(lines)
