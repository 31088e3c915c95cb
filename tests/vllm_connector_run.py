"""Runs one real vLLM engine with HurrayConnector in its own process (see test_vllm_connector.py).

Usage: python vllm_connector_run.py CONFIG_JSON RESULT_JSON
CONFIG: {"model", "block_size", "extra": {...connector extra config...},
         "prompts": {rid: [ids]}, "max_tokens", "policy"}
"""

from __future__ import annotations

import json
import os
import sys

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def main() -> None:
    cfg = json.loads(open(sys.argv[1]).read())
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    kv = None
    if cfg.get("extra") is not None:
        kv = KVTransferConfig(
            kv_connector="HurrayConnector",
            kv_connector_module_path="hurray_vllm.adapters.vllm.connector",
            kv_role="kv_both",
            kv_connector_extra_config=cfg["extra"],
            kv_load_failure_policy=cfg.get("policy", "recompute"),
        )
    llm = LLM(
        model=cfg["model"],
        skip_tokenizer_init=True,
        enforce_eager=True,
        dtype="bfloat16",
        block_size=cfg["block_size"],
        max_model_len=1024,
        kv_transfer_config=kv,
        enable_prefix_caching=False,
        seed=0,
    )
    sp = SamplingParams(detokenize=False, temperature=0, max_tokens=cfg["max_tokens"], ignore_eos=True)
    rids = list(cfg["prompts"])
    outs = llm.generate([TokensPrompt(prompt_token_ids=cfg["prompts"][r]) for r in rids], sp, use_tqdm=False)
    result = {
        "outputs": {r: list(o.outputs[0].token_ids) for r, o in zip(rids, outs)},
        "cached": {r: o.num_cached_tokens for r, o in zip(rids, outs)},
    }
    core = llm.llm_engine.engine_core.engine_core
    conn = getattr(core.scheduler, "connector", None)
    if conn is not None:
        result["scheduler_stats"] = vars(conn.stats)

    def worker_stats(worker):  # type: ignore[no-untyped-def]
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        conn = get_kv_transfer_group()
        assert conn.flush(timeout=60), "background saves did not finish"
        return vars(conn.stats)

    if kv is not None:
        result["worker_stats"] = llm.collective_rpc(worker_stats)[0]
    open(sys.argv[2], "w").write(json.dumps(result))


if __name__ == "__main__":
    main()
