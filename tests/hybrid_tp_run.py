"""Runs one real vLLM engine (CPU) with HurrayConnector, at a given tensor parallelism, in phases (hybrids too).

Usage: python hybrid_tp_run.py CONFIG_JSON OUT_DIR

CONFIG: ``{"model", "store", "tp", "block", "chunk", "max_model_len", "kv_cache_dtype", "async_scheduling",
"speculative", "phases": [{"prompts": {id: prompt}, "salts": {id: cache_salt}, "vanish": bool, "snapshot": bool,
"max_tokens": n, "reset_prefix_cache": bool}, ...]}``.
``block``, ``chunk``, ``max_model_len`` (2048), ``kv_cache_dtype`` ("auto"), ``async_scheduling``
(vLLM's, which the CPU platform turns off unless this is true: see ``vllm_patches``) and
``speculative`` (vLLM's ``speculative_config``) are optional: vLLM sizes a linear-attention hybrid's
blocks to its states (hundreds of tokens, CPU-dependent), and chunks default to one such block. A prompt is a list of
token ids, ``{"seed", "blocks", "extra"}``: ``blocks * B + extra`` tokens of a pattern seeded by
``seed``, for the engine's block size ``B``, or ``{"after": id, "tokens": k}``: an earlier phase's
prompt ``id`` and its first ``k`` generated tokens (the request moved mid-decode).
Each phase's prompts run as one batch, greedy, ``max_tokens`` (10) tokens each, after emptying
vLLM's own prefix cache if ``reset_prefix_cache`` (a load then comes from the store). With
``snapshot`` the phase is stepped by hand and ``snapshot()`` taken once every prompt is computed,
before the first decode step (``OUT_DIR/snap{phase}.hrry``; with ``"stream": true`` also
``snapshot_stream()``'s, ``OUT_DIR/snap{phase}.hrrs``). In a ``vanish`` phase the chunk files
disappear from the store right after the scheduler promised a load (as a ``hurray-vllm prune``
racing the load would make them): the workers, processes of their own at TP > 1, then fail to read
them. Writes ``OUT_DIR/result.json``: the block size and prompts, per phase the outputs, vLLM's
cached-token counts and the store's files (and those with linear-attention states), the
scheduler's and every rank's connector statistics, and whether vLLM kept its hybrid KV cache
manager.
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


def prompt(spec: list[int] | dict[str, Any], block: int, earlier: dict[str, Any]) -> list[int]:
    """The prompt's token ids: as given, ``blocks * block + extra`` tokens seeded by ``seed``, or a continuation.

    ``earlier``: the result so far (its ``prompts`` and ``phases``), for ``{"after": id, "tokens": k}``.
    """
    if isinstance(spec, list):
        return spec
    if "after" in spec:
        rid = spec["after"]
        (generated,) = [p["outputs"][rid] for p in earlier["phases"] if rid in p["outputs"]]
        return [*earlier["prompts"][rid], *generated[: spec["tokens"]]]
    seed = spec["seed"]
    return [(i * 37 + seed * 101 + 11) % 500 + 1 for i in range(spec["blocks"] * block + spec["extra"])]


def main() -> None:
    cfg = json.loads(Path(sys.argv[1]).read_text())
    out = Path(sys.argv[2])
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    import hurray_vllm as hv
    from hurray_vllm.adapters.vllm import snapshot, snapshot_stream
    from hurray_vllm.adapters.vllm._generate import warm_up
    from hurray_vllm.chunks.store import DirectoryStore

    store, tp = Path(cfg["store"]), int(cfg["tp"])
    stored = DirectoryStore(store)
    _race_prune(store)
    if cfg.get("async_scheduling"):
        from vllm_patches import keep_async_scheduling

        keep_async_scheduling()
    extra: dict[str, Any] = {"hurray_path": str(store), "hurray_save_async": False}  # phases end with their chunks
    if cfg.get("chunk"):
        extra["hurray_chunk_tokens"] = cfg["chunk"]
    kv = KVTransferConfig(
        kv_connector="HurrayConnector",
        kv_connector_module_path="hurray_vllm.adapters.vllm.connector",
        kv_role="kv_both",
        kv_connector_extra_config=extra,
        kv_load_failure_policy="recompute",
    )
    llm = LLM(
        model=cfg["model"],
        skip_tokenizer_init=True,
        enforce_eager=True,
        dtype="bfloat16",
        max_model_len=int(cfg.get("max_model_len", 2048)),
        max_num_batched_tokens=16384,
        tensor_parallel_size=tp,
        distributed_executor_backend="mp" if tp > 1 else None,
        kv_transfer_config=kv,
        seed=0,
        kv_cache_dtype=cfg.get("kv_cache_dtype", "auto"),
        async_scheduling=cfg.get("async_scheduling"),
        speculative_config=cfg.get("speculative"),
        **({"block_size": cfg["block"]} if cfg.get("block") else {}),
    )
    warm_up(llm)  # CPUs with AMX: a first attention call of 4 tokens or fewer would kill the engine
    eng = llm.llm_engine
    core: Any = eng.engine_core.engine_core
    block = int(eng.vllm_config.cache_config.block_size)
    result: dict[str, Any] = {"tp": tp, "block_size": block, "prompts": {}, "phases": []}
    result["async_scheduling"] = bool(eng.vllm_config.scheduler_config.async_scheduling)
    for n, phase in enumerate(cfg["phases"]):
        sp = SamplingParams(detokenize=False, temperature=0, max_tokens=phase.get("max_tokens", 10), ignore_eos=True)
        if phase.get("reset_prefix_cache") and not llm.reset_prefix_cache():
            raise RuntimeError("vLLM did not empty its prefix cache")
        prompts = {rid: prompt(spec, block, result) for rid, spec in phase["prompts"].items()}
        salts = phase.get("salts") or {}
        inputs = {
            rid: TokensPrompt(prompt_token_ids=ids, **({"cache_salt": salts[rid]} if rid in salts else {}))
            for rid, ids in prompts.items()
        }
        result["prompts"].update(prompts)
        VANISH["on"] = bool(phase.get("vanish"))
        outputs: dict[str, list[int]] = {}
        cached: dict[str, int] = {}
        if phase.get("snapshot"):
            for rid in prompts:
                eng.add_request(rid, inputs[rid], sp)
            taken = False
            while eng.has_unfinished_requests():
                for o in eng.step():
                    if o.finished:
                        outputs[o.request_id] = list(o.outputs[0].token_ids)
                        cached[o.request_id] = o.num_cached_tokens
                reqs = list(core.scheduler.requests.values())
                if not taken and reqs and all(r.num_computed_tokens >= r.num_prompt_tokens for r in reqs):
                    hv.save(snapshot(llm, list(prompts)), out / f"snap{n}.hrry")
                    if phase.get("stream"):
                        with open(out / f"snap{n}.hrrs", "wb") as f:
                            snapshot_stream(llm, list(prompts), f)
                    taken = True
        else:
            ids = list(prompts)
            outs = llm.generate([inputs[i] for i in ids], sp, use_tqdm=False)
            outputs = {i: list(o.outputs[0].token_ids) for i, o in zip(ids, outs, strict=True)}
            cached = {i: o.num_cached_tokens for i, o in zip(ids, outs, strict=True)}
        VANISH["on"] = False
        files = sorted(store.rglob("*.hrry"))
        with_states = [p.name for p in files if stored.has_states(p.parent.name, p.stem)]
        result["phases"].append(
            {"outputs": outputs, "cached": cached, "files": [p.name for p in files], "with_states": with_states}
        )
    result["promised_then_vanished"] = VANISH["promised"]
    result["scheduler_stats"] = dict(vars(core.scheduler.connector.stats))
    result["worker_stats"] = llm.collective_rpc(_stats)
    result["hybrid_kv_cache_manager"] = not eng.vllm_config.scheduler_config.disable_hybrid_kv_cache_manager
    (out / "result.json").write_text(json.dumps(result))


def _stats(worker: Any) -> dict[str, Any]:
    """Runs on every worker: its connector's statistics."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    return dict(vars(get_kv_transfer_group().stats))


if __name__ == "__main__":  # the mp executor spawns its workers: they import this module
    main()
