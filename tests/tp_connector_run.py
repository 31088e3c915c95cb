"""Runs one real vLLM engine (CPU) with HurrayConnector at a given tensor parallelism, on a chunk store.

Usage: python tp_connector_run.py MODEL_DIR OUT_DIR STORE_DIR TP [URL]

``kv_both``: loads what the store holds and saves what it lacks. Records the
greedy outputs, vLLM's cached-token counts and the connector's statistics
(the scheduler's; the workers run in processes of their own at TP > 1) in
``OUT_DIR/result.json``, and the store's files in ``files``. With ``URL``
(``hurray_url``), every rank also pushes the slices it saves to that receiver.
``HURRAY_TEST_SAVE_ASYNC=1``: the default background saves, flushed on every
rank before the store is listed; otherwise synchronous saves.
``HURRAY_TEST_EAGLE=DIR``: speculative decoding with the EAGLE head in ``DIR``; then also one more
request snapshotted mid-decode (``live.hrry``, ``snapshot()``; ``ranks/``, ``snapshot_ranks()``).
``HURRAY_TEST_SNAPSHOT=1``: then also :func:`snapshot_prompts` run again, snapshotted after their
prefill and two decode steps (``snap.hrry``, ``snap.hrrs``, ``ranks/``) for ``test_tp.py``; they complete
no chunk or tail of their own.
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
CHUNK = 32


def prompts() -> dict[str, list[int]]:
    a = [(i * 37 + 11) % 500 + 1 for i in range(100)]
    return {
        "a": a,
        "b": [*a[:64], 3, 1, 4, 1, 5, 9, 2],  # shares two chunks with "a"
        "c": [17, 42, 99, 256, 8],  # shorter than a chunk
        # Shares nothing: the test deletes one rank's slice of its second chunk before the loads.
        "d": [(i * 53 + 7) % 500 + 1 for i in range(100)],
    }


def snapshot_prompts() -> dict[str, list[int]]:
    """What ``HURRAY_TEST_SNAPSHOT`` snapshots: "b" shares 80 tokens (two chunks and half a block) with "a"."""
    a = prompts()["a"]
    return {"a": a, "b": [*a[:80], 3, 1, 4, 1, 5, 9, 2], "c": [17, 42, 99, 256, 8]}


def main() -> None:
    model, out, store, tp = sys.argv[1], Path(sys.argv[2]), sys.argv[3], int(sys.argv[4])
    url = sys.argv[5] if len(sys.argv) > 5 else None
    save_async = os.environ.get("HURRAY_TEST_SAVE_ASYNC") == "1"
    eagle = os.environ.get("HURRAY_TEST_EAGLE")
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    kv = KVTransferConfig(
        kv_connector="HurrayConnector",
        kv_connector_module_path="hurray_vllm.adapters.vllm.connector",
        kv_role="kv_both",
        # Saves in the background (the default) with HURRAY_TEST_SAVE_ASYNC=1: each worker process's
        # writer, flushed below before the store is listed; else synchronous, inside the steps.
        kv_connector_extra_config={
            "hurray_path": store,
            "hurray_chunk_tokens": CHUNK,
            "hurray_save_async": save_async,
            **({"hurray_url": url} if url else {}),
        },
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
        # HURRAY_TEST_EAGLE: an EAGLE head's directory (its layer's KV is split over the ranks as the model's).
        speculative_config={"method": "eagle", "model": eagle, "num_speculative_tokens": 2} if eagle else None,
    )
    result: dict[str, Any] = {"prompts": prompts(), "tp": tp, "chunk_tokens": CHUNK}
    sp = SamplingParams(detokenize=False, temperature=0, max_tokens=12, ignore_eos=True)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in result["prompts"].values()], sp, use_tqdm=False)
    result["outputs"] = {r: list(o.outputs[0].token_ids) for r, o in zip(result["prompts"], outs, strict=True)}
    result["cached"] = {r: o.num_cached_tokens for r, o in zip(result["prompts"], outs, strict=True)}
    core: Any = llm.llm_engine.engine_core.engine_core
    result["scheduler_stats"] = dict(vars(core.scheduler.connector.stats))
    if eagle:
        result["live"] = _snapshot_live(llm, out, result["prompts"]["a"][:70])
    result["save_async"] = save_async
    result["flushed"] = llm.collective_rpc(_flush)  # every rank's writer done (and its pushes answered)
    result["files"] = sorted(p.name for p in Path(store).rglob("*.hrry*"))
    if os.environ.get("HURRAY_TEST_SNAPSHOT") == "1":
        result["rank_files"] = _snapshot_prompts(llm, out)
    (out / "result.json").write_text(json.dumps(result))


def _snapshot_prompts(llm: Any, out: Path) -> list[str]:
    """:func:`snapshot_prompts` after their prefill and two decode steps: ``snapshot()``, ``snapshot_stream()`` and
    ``snapshot_ranks()``; returns the rank files' paths under ``out``."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    import hurray_vllm as hv
    from hurray_vllm.adapters.vllm import snapshot, snapshot_ranks, snapshot_stream

    eng, ids = llm.llm_engine, list(snapshot_prompts())
    sp = SamplingParams(detokenize=False, temperature=0, max_tokens=8, ignore_eos=True)  # "b" ends at 95 < 96
    for rid, prompt in snapshot_prompts().items():
        eng.add_request(rid, TokensPrompt(prompt_token_ids=prompt), sp)
    for _ in range(3):  # the prefill and two decode steps
        eng.step()
    hv.save(snapshot(llm, ids), out / "snap.hrry")
    with open(out / "snap.hrrs", "wb") as f:
        snapshot_stream(llm, ids, f)
    files = snapshot_ranks(llm, ids, out / "ranks")
    while eng.has_unfinished_requests():
        eng.step()
    return [str(p.relative_to(out)) for p in files]


def _snapshot_live(llm: Any, out: Path, prompt: list[int]) -> dict[str, Any]:
    """A request mid-decode (its first two chunks loaded), written by ``snapshot()`` and ``snapshot_ranks()``.

    With an EAGLE head both name the model's layers (``hurray_vllm.target_layers``): the head's layer is
    the last, split over the ranks like the model's.
    """
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    import hurray_vllm as hv
    from hurray_vllm.adapters.vllm import snapshot, snapshot_ranks

    eng = llm.llm_engine
    eng.add_request("live", TokensPrompt(prompt_token_ids=prompt), SamplingParams(temperature=0, max_tokens=8))
    for _ in range(3):  # the prefill and two decode steps
        eng.step()
    hv.save(snapshot(llm, ["live"]), out / "live.hrry")
    files = snapshot_ranks(llm, ["live"], out / "ranks")
    while eng.has_unfinished_requests():
        eng.step()
    return {"snap": "live.hrry", "ranks": [str(p.relative_to(out)) for p in files]}


def _flush(worker: Any) -> bool:
    """Runs on every worker: wait for its connector's background writes (True at once for synchronous saves)."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    return bool(get_kv_transfer_group().flush(timeout=120))


if __name__ == "__main__":  # the mp executor spawns its workers: they import this module
    main()
