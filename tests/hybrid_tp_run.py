"""Runs one real vLLM engine (CPU) on a sliding-window hybrid with HurrayConnector, at a given tensor parallelism.

Usage: python window_tp_run.py CONFIG_JSON OUT_DIR

CONFIG: ``{"model", "store", "tp", "block", "chunk", "phases": [{"prompts": {id: [token ids]},
"vanish": bool}, ...]}``. Each phase's prompts run as one batch, greedy, 10 tokens each. In a
``vanish`` phase the chunk files disappear from the store right after the scheduler promised a
load (as a ``hurray-vllm prune`` racing the load would make them): the workers, processes of their
own at TP > 1, then fail to read them. Writes ``OUT_DIR/result.json``: per phase the outputs and
vLLM's cached-token counts, the scheduler's and every rank's connector statistics, the store's
files after each phase, and whether vLLM kept its hybrid KV cache manager.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

VANISH = {"on": False, "promised": 0}


def _race_prune(store: Path) -> None:
    """Delete every chunk file right after the scheduler promised a load (patched into this process only)."""
    from hurray_vllm.adapters.vllm.connector.scheduler import HurrayScheduler

    plain = HurrayScheduler.get_num_new_matched_tokens

    def racing(self: Any, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        matched, is_async = plain(self, request, num_computed_tokens)
        if VANISH["on"] and matched:
            VANISH["promised"] += 1
            for f in store.rglob("*.hrry"):
                f.unlink()
        return matched, is_async

    HurrayScheduler.get_num_new_matched_tokens = racing  # type: ignore[method-assign]


def main() -> None:
    cfg = json.loads(Path(sys.argv[1]).read_text())
    out = Path(sys.argv[2])
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    store, tp = Path(cfg["store"]), int(cfg["tp"])
    _race_prune(store)
    kv = KVTransferConfig(
        kv_connector="HurrayConnector",
        kv_connector_module_path="hurray_vllm.adapters.vllm.connector",
        kv_role="kv_both",
        kv_connector_extra_config={
            "hurray_path": str(store),
            "hurray_chunk_tokens": cfg["chunk"],
            "hurray_save_async": False,  # each phase's chunks are in the store when it ends
        },
        kv_load_failure_policy="recompute",
    )
    llm = LLM(
        model=cfg["model"],
        skip_tokenizer_init=True,
        enforce_eager=True,
        dtype="bfloat16",
        block_size=cfg["block"],
        max_model_len=1024,
        tensor_parallel_size=tp,
        distributed_executor_backend="mp" if tp > 1 else None,
        kv_transfer_config=kv,
        seed=0,
    )
    sp = SamplingParams(detokenize=False, temperature=0, max_tokens=10, ignore_eos=True)
    result: dict[str, Any] = {"tp": tp, "phases": []}
    for phase in cfg["phases"]:
        VANISH["on"] = bool(phase.get("vanish"))
        ids = list(phase["prompts"])
        outs = llm.generate([TokensPrompt(prompt_token_ids=phase["prompts"][i]) for i in ids], sp, use_tqdm=False)
        VANISH["on"] = False
        result["phases"].append(
            {
                "outputs": {i: list(o.outputs[0].token_ids) for i, o in zip(ids, outs, strict=True)},
                "cached": {i: o.num_cached_tokens for i, o in zip(ids, outs, strict=True)},
                "files": sorted(p.name for p in store.rglob("*.hrry")),
            }
        )
    core: Any = llm.llm_engine.engine_core.engine_core
    result["promised_then_vanished"] = VANISH["promised"]
    result["scheduler_stats"] = dict(vars(core.scheduler.connector.stats))
    result["worker_stats"] = llm.collective_rpc(_stats)
    result["hybrid_kv_cache_manager"] = not llm.llm_engine.vllm_config.scheduler_config.disable_hybrid_kv_cache_manager
    (out / "result.json").write_text(json.dumps(result))


def _stats(worker: Any) -> dict[str, Any]:
    """Runs on every worker: its connector's statistics."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    return dict(vars(get_kv_transfer_group().stats))


if __name__ == "__main__":  # the mp executor spawns its workers: they import this module
    main()
