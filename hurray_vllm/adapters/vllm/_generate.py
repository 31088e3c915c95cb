"""Run one offline vLLM engine over token-id prompts, in its own process (used by the demo).

Usage: python -m hurray_vllm.adapters.vllm._generate CONFIG_JSON RESULT_JSON

CONFIG: {"model", "block_size", "prompts": {id: [token ids]}, "max_tokens": {id: n},
         "connector": {extra config} | null}
RESULT: {"outputs": {id: [token ids]}, "cached": {id: num_cached_tokens}}
"""

from __future__ import annotations

import json
import os
import sys


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
            kv_role="kv_both",
            kv_connector_extra_config=cfg["connector"],
            kv_load_failure_policy="recompute",
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
    ids = list(cfg["prompts"])
    params = [
        SamplingParams(detokenize=False, temperature=0, max_tokens=cfg["max_tokens"][i], ignore_eos=True) for i in ids
    ]
    outs = llm.generate([TokensPrompt(prompt_token_ids=cfg["prompts"][i]) for i in ids], params, use_tqdm=False)
    result = {
        "outputs": {i: list(o.outputs[0].token_ids) for i, o in zip(ids, outs)},
        "cached": {i: o.num_cached_tokens for i, o in zip(ids, outs)},
    }
    with open(sys.argv[2], "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
