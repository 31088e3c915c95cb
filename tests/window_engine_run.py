"""Runs one real vLLM engine (CPU) on a tiny sliding-window hybrid (Gemma 3 style) and snapshots it mid-decode.

Usage: python window_engine_run.py MODEL_DIR OUT_DIR

Writes ``snap.hrry`` and ``snap.hrrs`` after the prefill and two decode
steps (by then vLLM has freed the sliding-window blocks out of the window),
and the greedy outputs and block tables in ``result.json``.
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
    a = [(i * 37 + 11) % 500 + 1 for i in range(200)]
    return {
        "a": a,  # longer than the window: its sliding layers drop the first blocks
        "b": [*a[:96], 3, 1, 4, 1, 5, 9, 2, 6],  # shares three blocks with "a" (prefix caching)
        "c": [17, 42, 99, 256, 8],  # shorter than a block and than the window
    }


def main() -> None:
    model, out = sys.argv[1], Path(sys.argv[2])
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    import hurray_vllm as hv
    from hurray_vllm.adapters.vllm import snapshot, snapshot_stream

    llm = LLM(
        model=model,
        skip_tokenizer_init=True,
        enforce_eager=True,
        dtype="bfloat16",
        block_size=BLOCK,
        max_model_len=512,
        seed=0,
    )
    result: dict[str, Any] = {"prompts": prompts(), "block_size": BLOCK}
    eng = llm.llm_engine
    core: Any = eng.engine_core.engine_core
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
        if steps == 3:  # prefill, then two decode steps: the freed blocks are null by now
            hv.save(snapshot(llm, ["a", "b", "c"]), out / "snap.hrry")
            with open(out / "snap.hrrs", "wb") as f:
                snapshot_stream(llm, ["a", "b", "c"], f)
            sched = core.scheduler
            result["block_ids"] = {
                r.request_id: [list(g) for g in sched.kv_cache_manager.get_block_ids(r.request_id)]
                for r in sched.requests.values()
            }
    result["outputs"] = outputs
    result["hybrid_manager_off"] = bool(eng.vllm_config.scheduler_config.disable_hybrid_kv_cache_manager)
    (out / "result.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
