"""Runs one real vLLM engine (CPU) at a given tensor parallelism and snapshots it mid-decode.

Usage: python tp_engine_run.py MODEL_DIR OUT_DIR TP

At TP = 2 the workers are processes of their own (vLLM's ``mp`` executor,
one core each: ``VLLM_CPU_OMP_THREADS_BIND="0|1"``, set by the caller); the
engine core stays in this process, so that ``snapshot()`` can reach the
scheduler. Writes ``snap.hrry``, ``snap.hrrs`` and each rank's own stream
(``ranks/``, ``snapshot_ranks``) after the prefill and two decode steps, and
the greedy outputs in ``result.json``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

BLOCK = 32


def prompts() -> dict[str, list[int]]:
    a = [(i * 37 + 11) % 500 + 1 for i in range(100)]
    return {
        "a": a,
        "b": [*a[:80], 3, 1, 4, 1, 5, 9, 2],  # shares 80 tokens with "a"
        "c": [17, 42, 99, 256, 8],  # shorter than a block
    }


def main() -> None:
    model, out, tp = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    import hurray_vllm as hv
    from hurray_vllm.adapters.vllm import snapshot

    llm = LLM(
        model=model,
        skip_tokenizer_init=True,
        enforce_eager=True,
        dtype="bfloat16",
        block_size=BLOCK,
        max_model_len=512,
        tensor_parallel_size=tp,
        distributed_executor_backend="mp" if tp > 1 else None,
        seed=0,
    )
    result: dict[str, Any] = {"prompts": prompts(), "tp": tp}
    eng = llm.llm_engine
    sp = SamplingParams(detokenize=False, temperature=0, max_tokens=12, ignore_eos=True)
    for rid, ids in result["prompts"].items():
        eng.add_request(rid, TokensPrompt(prompt_token_ids=ids), sp)
    outputs: dict[str, list[int]] = {}
    steps = 0
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                outputs[o.request_id] = list(o.outputs[0].token_ids)
        steps += 1
        if steps == 3:  # the prefill and two decode steps
            hv.save(snapshot(llm, list(result["prompts"])), out / "snap.hrry")
            with open(out / "snap.hrrs", "wb") as f:
                from hurray_vllm.adapters.vllm import snapshot_stream

                snapshot_stream(llm, list(result["prompts"]), f)
            from hurray_vllm.adapters.vllm import snapshot_ranks

            files = snapshot_ranks(llm, list(result["prompts"]), out / "ranks")
            result["rank_files"] = [str(p.relative_to(out)) for p in files]
    result["outputs"] = outputs
    (out / "result.json").write_text(json.dumps(result))


if __name__ == "__main__":  # the mp executor spawns its workers: they import this module
    main()
