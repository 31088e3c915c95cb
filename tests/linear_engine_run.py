"""Runs one real vLLM engine (CPU) on a tiny linear-attention hybrid (Qwen3-Next style) with HurrayConnector.

Usage: python linear_engine_run.py MODEL_DIR OUT_DIR STORE_DIR (save|load) [MORE_PROMPTS_JSON]
       [--ssm-dtype DTYPE] [--snapshot] [--move-after N]

``save`` snapshots the requests after their prefill (``OUT_DIR/prefill.hrry``)
and mid-decode (``OUT_DIR/snap.hrry``) while the connector saves every
whole chunk to ``STORE_DIR``; ``load`` runs the same prompts against a
store, and those of ``MORE_PROMPTS_JSON`` (``{id: [token ids]}``) too.
Both record the greedy outputs, vLLM's cached-token counts, the
connector's statistics and the block tables in ``OUT_DIR/result.json``.
Prefix caching is vLLM's default (on), so its state groups run in
``mamba_cache_mode="align"`` with blocks vLLM sizes to the state's page: 384
tokens on an AVX2 machine, 640 with AVX-512. The chunk is one block (the
connector's default for blocks over 256 tokens), and the prompts are laid
out in blocks ``B`` once the engine said what ``B`` is, so that every CPU
runs the same schedule. The token budget takes every prompt's first step at
once: vLLM then prefills each up to its last block boundary in the first
step and the rest in the second.

Variants: ``--ssm-dtype`` is vLLM's ``mamba_ssm_cache_dtype`` (CPUs with
avx512_bf16 keep a 16-bit one for the accelerated GDN backend, and reset
any other to float32); the conv-state layout follows the environment
(``VLLM_SSM_CONV_STATE_LAYOUT``). ``--snapshot`` takes the two snapshots in
``load`` mode too. ``--move-after N``: once every request finished and the
connector's saves are written, vLLM's own prefix cache is emptied and
``d_moved``, "d"'s prompt and its first ``N`` generated tokens, runs on the
same engine: it resumes from the chunks this run saved. ``result.json``
also records the state dtype vLLM kept, the conv-state layout it used and
its state tensors' shapes and dtypes.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def prompts(b: int) -> dict[str, list[int]]:
    """The requests, in blocks of ``b`` tokens (one chunk each); with ``b`` = 384: 1000, 769, 5, 760 and 400 tokens."""
    a = [(i * 37 + 11) % 500 + 1 for i in range(2 * b + 232)]
    d = [(i * 53 + 7) % 500 + 1 for i in range(2 * b - 8)]
    return {
        "a": a,  # prefilled in two steps, 0..2b and 2b..: chunk 1 holds the state at 2b, chunk 0 none
        # Shares both chunks with "a", and resumes at 2b with one token to compute: its first token follows
        # from the loaded states directly (after a few more tokens, this tiny model's gates have forgotten them).
        "b": [*a[: 2 * b], 3],
        "c": [17, 42, 99, 256, 8],  # shorter than a block
        "d": d,  # prefilled 0..b and b..2b-8: chunk 0 holds the state at b; chunk 1 ends in the 8th decode step
        # Shares chunk 0 with "a" and is prefilled 0..b in the step "a" runs 0..2b: its chunk 0 has the
        # state "a"'s has not, and is the one stored.
        "e": [*a[:b], *range(100, 116)],
    }


def _engine_states(worker: Any) -> dict[str, Any]:
    """Runs on the worker: the conv-state layout vLLM used, and each state layer's tensors (per block, as held)."""
    from vllm.model_executor.layers.mamba.mamba_utils import get_conv_state_layout

    ctx = worker.vllm_config.compilation_config.static_forward_context
    layers = {
        name: [[list(t.shape[1:]), str(t.dtype).removeprefix("torch.")] for t in layer.kv_cache]
        for name, layer in ctx.items()
        if isinstance(getattr(layer, "kv_cache", None), (list, tuple)) and len(layer.kv_cache) == 2
    }
    return {"conv_layout": get_conv_state_layout(), "layers": layers}


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser()
    for name in ("model", "out", "store", "mode"):
        parser.add_argument(name)
    parser.add_argument("more", nargs="?")
    parser.add_argument("--ssm-dtype", default="auto")
    parser.add_argument("--snapshot", action="store_true")
    parser.add_argument("--move-after", type=int, default=0)
    args = parser.parse_args()
    model, out, store, mode = args.model, Path(args.out), args.store, args.mode
    more: dict[str, list[int]] = json.loads(Path(args.more).read_text()) if args.more else {}
    snapshots = mode == "save" or args.snapshot
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
        kv_connector_extra_config={"hurray_path": store},  # chunks of one block: the default for blocks > 256
        kv_load_failure_policy="recompute",
    )
    llm = LLM(
        model=model,
        skip_tokenizer_init=True,
        enforce_eager=True,
        dtype="bfloat16",
        max_model_len=2048,
        max_num_batched_tokens=16384,
        kv_transfer_config=kv,
        seed=0,
        mamba_ssm_cache_dtype=args.ssm_dtype,
    )
    eng = llm.llm_engine
    core: Any = eng.engine_core.engine_core  # in-process engine core (VLLM_ENABLE_V1_MULTIPROCESSING=0)
    block = int(eng.vllm_config.cache_config.block_size)
    chunk = core.scheduler.connector._config.chunk_tokens
    if chunk != block or block < 256 or 2 * block + 248 > 2048:
        raise SystemExit(f"this test needs chunks of one block of 256 to 900 tokens; vLLM chose blocks of {block}")
    result: dict[str, Any] = {"prompts": {**prompts(block), **more}, "chunk_tokens": chunk}
    sp = SamplingParams(detokenize=False, temperature=0, max_tokens=16, ignore_eos=True)
    for rid, ids in result["prompts"].items():
        eng.add_request(rid, TokensPrompt(prompt_token_ids=ids), sp)
    outputs: dict[str, list[int]] = {}
    cached: dict[str, int] = {}
    steps = 0
    taken = False
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                outputs[o.request_id] = list(o.outputs[0].token_ids)
                cached[o.request_id] = o.num_cached_tokens
        steps += 1
        reqs = list(core.scheduler.requests.values())
        if snapshots and not taken and reqs and all(r.num_computed_tokens >= r.num_prompt_tokens for r in reqs):
            # Every prompt computed, no decode step yet: transformers' prefill is the ground truth here.
            hv.save(snapshot(llm, list(result["prompts"])), out / "prefill.hrry")
            taken = True
        elif snapshots and taken and "snap" not in result:
            hv.save(snapshot(llm, list(result["prompts"])), out / "snap.hrry")  # one decode step later
            result["snap"] = steps
    if args.move_after:
        llm.collective_rpc(_worker_stats)  # every chunk saved so far is in the store
        if not llm.reset_prefix_cache():
            raise RuntimeError("vLLM did not empty its prefix cache")
        moved = [*result["prompts"]["d"], *outputs["d"][: args.move_after]]
        result["prompts"]["d_moved"] = moved
        eng.add_request("d_moved", TokensPrompt(prompt_token_ids=moved), sp)
        while eng.has_unfinished_requests():
            for o in eng.step():
                if o.finished:
                    outputs[o.request_id] = list(o.outputs[0].token_ids)
                    cached[o.request_id] = o.num_cached_tokens
    result["scheduler_stats"] = dict(vars(core.scheduler.connector.stats))
    result["worker_stats"] = llm.collective_rpc(_worker_stats)[0]
    result["engine_states"] = llm.collective_rpc(_engine_states)[0]
    result["mamba_ssm_cache_dtype"] = str(eng.vllm_config.cache_config.mamba_ssm_cache_dtype)
    cfg = eng.vllm_config
    result["hybrid_manager_off"] = bool(cfg.scheduler_config.disable_hybrid_kv_cache_manager)
    result["prefix_caching"] = bool(cfg.cache_config.enable_prefix_caching)
    result["mamba_cache_mode"] = str(cfg.cache_config.mamba_cache_mode)
    result["block_size"] = int(cfg.cache_config.block_size)
    result["outputs"] = outputs
    result["cached"] = cached
    (out / "result.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
