"""GPU check of the vLLM connector's stream ordering (docs/vllm.md, "What
holds under TP, preemption, aborts and sleep"): prepared for a machine with a
CUDA GPU and torch with CUDA, no vLLM needed.  Not run on the 2-core x86 VM
(no GPU there).

    python bench/gpu_check_vllm_order.py            # exit 0: every check held

Two ConnectorWorkers on real SyncBridges over loopback TCP: a prefill whose
KV cache is vLLM-shaped CUDA views (kvbridge.testing.engine_caches, the
layout vLLM's GPU backends use) and a decode with CUDA views too.  The
prefill's "forward" writes each layer with a slow kernel on vLLM's current
stream (``torch.cuda._sleep`` and then the layer's bytes), and calls
``save_kv_layer`` right after launching it, as vLLM does:

1. ordered (the connector's CudaEvents): every byte the decode receives is
   the layer's final content, never the stale bytes the cache held before;
2. the control, the same run with no events (a layer released when
   ``save_kv_layer`` is called): the decode receives stale bytes, so check 1
   is able to fail (if the control comes out clean the run is inconclusive:
   raise --sleep-cycles);
3. the receive side: a kernel on vLLM's stream reads the decode's blocks
   right after the worker reported them in ``finished_recving`` and finds
   the prefill's bytes;
4. nothing waits on the whole device: the worker's host thread never calls
   torch.cuda.synchronize() (patched to raise during the run).
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from kvbridge.bridge.sync import SyncBridge
from kvbridge.integrations.vllm.config import ConnectorConfig, PeerSpec
from kvbridge.integrations.vllm.order import CudaEvents
from kvbridge.integrations.vllm.plan import FinishedSend, RecvPlan, SendPlan, StepPlan
from kvbridge.integrations.vllm.worker import ConnectorWorker
from kvbridge.pack import PagedKVCache
from kvbridge.testing.engine_caches import vllm_kv_caches

LAYERS, BLOCKS, HEADS, BLOCK, HEAD = 8, 64, 8, 16, 128
TOKENS = 200
P_TABLE = list(range(3, 3 + (TOKENS + BLOCK - 1) // BLOCK))
D_TABLE = list(range(20, 20 + (TOKENS + BLOCK - 1) // BLOCK))
NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]


def caches() -> list[torch.Tensor]:
    return vllm_kv_caches(
        num_layers=LAYERS,
        num_blocks=BLOCKS,
        num_kv_heads=HEADS,
        block_size=BLOCK,
        head_size=HEAD,
        dtype=torch.bfloat16,
        layout="LBHNC",
        device="cuda",
    )


def run(ordered: bool, sleep_cycles: int) -> tuple[bool, bool]:
    """(decode got exactly the final bytes, receive visible on vLLM's stream)."""
    pt, dt = caches(), caches()
    stale = 0x5A5A
    for t in pt:
        t.view(torch.int16).fill_(stale)
    final = [torch.randint(-30000, 30000, t.shape, dtype=torch.int16, device="cuda") for t in pt]
    torch.cuda.synchronize()
    pcache = PagedKVCache.from_vllm(pt, kv_split="last_dim", block_tokens=BLOCK)
    dcache = PagedKVCache.from_vllm(dt, kv_split="last_dim", block_tokens=BLOCK)
    d = ConnectorWorker(
        ConnectorConfig(identity="md", model_id="m", listen=("127.0.0.1", 0), recv_timeout_s=60),
        producer=False,
        consumer=True,
        make_bridge=SyncBridge,
    )
    d.register(dcache, NAMES, 1)
    p = ConnectorWorker(
        ConnectorConfig(
            identity="prefill-0",
            model_id="m",
            peers=(PeerSpec("md", "127.0.0.1", d.tcp_port),),
        ),
        producer=True,
        consumer=False,
        make_bridge=SyncBridge,
        events=CudaEvents("cuda") if ordered else None,
    )
    p.register(pcache, NAMES, 1)
    real_sync = torch.cuda.synchronize

    def no_device_sync(*_a: object, **_k: object) -> None:
        raise AssertionError("the connector waited on the whole device")

    try:
        t0 = time.monotonic()
        while "md" not in p._connected_names():
            assert time.monotonic() - t0 < 30, "the prefill does not connect"
            time.sleep(0.01)
        d.bind(StepPlan(recvs=[RecvPlan("d1", "t1", "prefill-0", D_TABLE, 0, TOKENS)]))
        d.begin_step()
        d.end_step()
        d.results()
        t0 = time.monotonic()
        while True:
            p.bind(StepPlan())
            p.end_step()
            p.results()
            rep = p.report()
            if rep is not None and "t1" in rep.tickets:
                break
            assert time.monotonic() - t0 < 30, "no ticket"
            time.sleep(0.005)
        torch.cuda.synchronize = no_device_sync  # type: ignore[assignment]
        stream = torch.cuda.current_stream()
        p.bind(StepPlan(sends=[SendPlan("p1", "t1", ("md",), P_TABLE, TOKENS)]))
        p.begin_step()
        for i, name in enumerate(NAMES):  # the forward: a slow kernel, then the layer's write
            with torch.cuda.stream(stream):
                torch.cuda._sleep(sleep_cycles)
                pt[i].view(torch.int16).copy_(final[i])
            p.layer_saved(name)
        p.end_step()
        p.results()
        p.bind(StepPlan(finished_sends={"p1": FinishedSend("t1", hold=True, aborted=False)}))
        p.begin_step()
        p.end_step()
        visible = True
        t0 = time.monotonic()
        got_d = False
        while not got_d:
            assert time.monotonic() - t0 < 120, "the transfer does not end"
            p.results()
            d.bind(StepPlan())
            d.begin_step()
            d.end_step()
            _, fr, ff = d.results()
            if "d1" in fr:
                assert not ff, "the receive failed"
                got_d = True
                # 3: read on vLLM's stream right after the report
                with torch.cuda.stream(stream):
                    for i in range(LAYERS):
                        a = dt[i].view(torch.int16)[D_TABLE[0]].clone()
                        b = final[i][P_TABLE[0]]
                        visible &= bool(torch.equal(a, b))
            time.sleep(0.002)
        torch.cuda.synchronize = real_sync  # type: ignore[assignment]
        torch.cuda.synchronize()
        same = True
        for i in range(LAYERS):
            for t in range(TOKENS):
                pb, po = P_TABLE[t // BLOCK], t % BLOCK
                db, do = D_TABLE[t // BLOCK], t % BLOCK
                a = dt[i].view(torch.int16)[db, :, do]
                b = final[i][pb, :, po]
                if not torch.equal(a, b):
                    same = False
                    break
        return same, visible
    finally:
        torch.cuda.synchronize = real_sync  # type: ignore[assignment]
        p.shutdown()
        d.shutdown()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sleep-cycles", type=int, default=200_000_000)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: nothing checked")
        return 2
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}")
    same, visible = run(True, a.sleep_cycles)
    print(f"ordered: decode holds the final bytes: {same}; visible on vLLM's stream: {visible}")
    ctl, _ = run(False, a.sleep_cycles)
    print(f"control (no events): decode holds the final bytes: {ctl} (expected False)")
    ok = same and visible and not ctl
    print("PASS" if ok else ("INCONCLUSIVE: raise --sleep-cycles" if same and ctl else "FAIL"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
