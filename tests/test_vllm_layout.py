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
from kvbridge.integrations.vllm.cache import describe_vllm_cache

H, D, L = 3, 64, 2
torch.manual_seed(0)

def views(blocks, bs, dtype):
    flat = torch.zeros(L * blocks * H * bs * 2 * D, dtype=dtype)
    v = flat.view(L, blocks, H, bs, 2 * D)  # vLLM CPU: LBHNC, one flat buffer
    return [v[i] for i in range(L)]

def write(layers, bs, table, toks, k, v):
    for li, kv in enumerate(layers):
        c = kv.view(kv.shape[0], H, bs * 2, -1)
        kc, vc = c.chunk(2, dim=2)  # as CPUAttentionBackendImpl.do_kv_cache_update
        slots = torch.tensor([table[t // bs] * bs + t % bs for t in toks], dtype=torch.int64)
        ops.cpu_attn_reshape_and_cache(k[li][toks].contiguous(), v[li][toks].contiguous(),
                                       kc, vc, slots, "vec")

for dtype in (torch.float32, torch.bfloat16):
    n = 100
    k = torch.randn(L, n, H, D).to(dtype)
    v = torch.randn(L, n, H, D).to(dtype)
    for (sb, db) in ((32, 64), (64, 32), (32, 32)):
        src = views(16, sb, dtype)
        stab = list(range(15, 15 - (n + sb - 1) // sb, -1))
        write(src, sb, stab, list(range(n)), k, v)
        dtab = [3, 6, 1, 4][: (n + db - 1) // db]
        for (s, e) in ((0, 100), (64, 100), (70, 99), (0, 5), (33, 65)):
            dst, ref = views(8, db, dtype), views(8, db, dtype)
            write(ref, db, dtab, list(range(s, e)), k, v)
            sc, _ = describe_vllm_cache(src, sb)
            dc, _ = describe_vllm_cache(dst, db)
            buf = sc.range(np.array(stab, np.int32), s, e, writable=False).pack()
            dc.range(np.array(dtab, np.int32), s, e).unpack(buf)
            ok = all(torch.equal(a, b) for a, b in zip(dst, ref))
            print(str(dtype), sb, db, s, e, "equal" if ok else "DIFFERENT", flush=True)
"""


def test_cpu_cache_matches_vllms_own_kernel() -> None:
    res = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, timeout=240)
    assert res.returncode == 0, res.stderr[-3000:]
    lines = [ln for ln in res.stdout.splitlines() if ln.endswith(("equal", "DIFFERENT"))]
    assert len(lines) == 2 * 3 * 5, res.stdout
    assert all(ln.endswith(" equal") for ln in lines), "\n".join(lines)
