"""Runs one real vLLM engine (CPU) in its own process and records what the tests check.

Usage: python vllm_engine_run.py MODEL_DIR OUT_DIR BLOCK_SIZE KV_CACHE_DTYPE

vLLM engines are expensive (seconds to start) and do not like sharing a
process, so each configuration runs once here and the tests read its results.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

SENTINEL = 0x7F  # fills every cache byte before any request runs


def prompts() -> dict[str, list[int]]:
    a = [(i * 37 + 11) % 500 + 1 for i in range(100)]
    return {
        "a": a,
        "b": [*a[:80], 3, 1, 4, 1, 5, 9, 2],  # shares 80 tokens with "a"
        "c": [17, 42, 99, 256, 8],  # shorter than a block
    }


def main() -> None:
    model, out, block_size, kv_dtype = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    import torch
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    import hurray_vllm as hv
    from hurray_vllm.adapters.vllm import snapshot, snapshot_stream

    result: dict = {"block_size": block_size, "kv_cache_dtype": kv_dtype, "prompts": prompts()}
    try:  # vLLM's own choice, made again at engine start (head_dim 32: tests/tiny_models.py)
        result["isa"] = _get_attn_isa(torch.bfloat16, block_size, 32, kv_dtype)
    except NotImplementedError as exc:  # e.g. fp8 caches on a CPU without AVX-512 or AMX
        result["unsupported"] = f"{exc} (this CPU: {torch.backends.cpu.get_cpu_capability()})"
        (out / "result.json").write_text(json.dumps(result))
        return
    llm = LLM(
        model=model,
        skip_tokenizer_init=True,
        enforce_eager=True,
        dtype="bfloat16",
        block_size=block_size,
        max_model_len=512,
        kv_cache_dtype=kv_dtype,
        seed=0,
    )

    def fill(worker):  # type: ignore[no-untyped-def]
        for t in worker.model_runner.kv_caches:
            t.view(-1).view(__import__("torch").uint8).fill_(SENTINEL)

    llm.collective_rpc(fill)
    eng = llm.llm_engine
    sp = SamplingParams(detokenize=False, temperature=0, max_tokens=12, ignore_eos=True)
    ps = result["prompts"]
    for rid, ids in ps.items():
        eng.add_request(rid, TokensPrompt(prompt_token_ids=ids), sp)
    eng.step()  # prefill
    eng.step()  # one decode step: snapshot mid-decode
    snap = snapshot(llm, ["a", "b", "c"])
    hv.save(snap, out / "snap.hrry")
    with open(out / "snap.hrrs", "wb") as f:
        snapshot_stream(llm, ["a", "b", "c"], f)
    errors = {}
    try:
        snapshot(llm, ["nope"])
    except hv.HurrayFormatError as exc:
        errors["unknown"] = str(exc)
    outputs: dict[str, list[int]] = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                outputs[o.request_id] = list(o.outputs[0].token_ids)
    try:
        snapshot(llm, ["c"])
    except hv.HurrayFormatError as exc:
        errors["finished"] = str(exc)
    result["outputs"] = outputs
    result["errors"] = errors
    (out / "result.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
