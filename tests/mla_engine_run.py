"""Runs one real vLLM engine (CPU) on a tiny MLA model with HurrayConnector saving, in its own process.

Usage: python mla_engine_run.py MODEL_DIR OUT_DIR

Takes a snapshot mid-decode (``snap.hrry``) and lets the connector save every
whole chunk to ``OUT_DIR/store``; records the greedy outputs and what
the tests check in ``result.json``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

BLOCK = 16  # vLLM's CPU MLA backend takes no other block size
CHUNK = 32


def prompts() -> dict[str, list[int]]:
    a = [(i * 37 + 11) % 500 + 1 for i in range(100)]
    return {
        "a": a,
        "b": [*a[:64], 3, 1, 4, 1, 5, 9, 2, 6],  # shares two chunks with "a"
        "c": [17, 42, 99, 256, 8],  # shorter than a block
    }


def main() -> None:
    model, out = sys.argv[1], Path(sys.argv[2])
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    import hurray_vllm as hv
    from hurray_vllm.adapters.vllm import snapshot

    kv = KVTransferConfig(
        kv_connector="HurrayConnector",
        kv_connector_module_path="hurray_vllm.adapters.vllm.connector",
        kv_role="kv_both",
        kv_connector_extra_config={"hurray_path": str(out / "store"), "hurray_chunk_tokens": CHUNK},
    )
    llm = LLM(
        model=model,
        skip_tokenizer_init=True,
        enforce_eager=True,
        dtype="bfloat16",
        block_size=BLOCK,
        max_model_len=512,
        kv_transfer_config=kv,
        seed=0,
    )
    result: dict = {"prompts": prompts(), "block_size": BLOCK, "chunk_tokens": CHUNK}
    eng = llm.llm_engine
    sp = SamplingParams(detokenize=False, temperature=0, max_tokens=12, ignore_eos=True)
    for rid, ids in result["prompts"].items():
        eng.add_request(rid, TokensPrompt(prompt_token_ids=ids), sp)
    eng.step()  # prefill
    eng.step()  # one decode step: snapshot mid-decode
    hv.save(snapshot(llm, ["a", "b", "c"]), out / "snap.hrry")
    outputs: dict[str, list[int]] = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                outputs[o.request_id] = list(o.outputs[0].token_ids)
    from hurray_vllm.adapters.vllm._generate import _worker_stats

    result["worker_stats"] = llm.collective_rpc(_worker_stats)[0]
    cfg = eng.vllm_config
    result["hybrid_manager_off"] = bool(cfg.scheduler_config.disable_hybrid_kv_cache_manager)
    result["prefix_caching"] = bool(cfg.cache_config.enable_prefix_caching)
    result["outputs"] = outputs
    (out / "result.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
