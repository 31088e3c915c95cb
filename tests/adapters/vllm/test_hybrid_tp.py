"""A sliding-window hybrid (Gemma 3 style) between real vLLM engines at TP = 1 and TP = 2 (CPU, one core per rank).

The model has 2 KV heads: a TP = 2 engine saves each chunk as two slices of
one head, every group's part in each (three sliding-window layers of window
64, one full-attention layer). One TP = 2 engine, in three batches:

1. loads "p" and "q" from chunks a TP = 1 engine saved;
2. loads "v" while a racing prune deletes every chunk file right after the
   scheduler promised the load: the workers (processes of their own) cannot
   read them. vLLM stops an engine of several KV cache groups whose worker
   reports failed *blocks*; the connector loads such engines through vLLM's
   asynchronous path, so the request fails, is recomputed, and the engine
   goes on;
3. computes "s", saving its slices;

and a TP = 1 engine then loads "s" and "v" from those slices. Every whole
chunk loads (vLLM's cached-token counts). A TP = 2 engine's all-reduces sum
in another order than TP = 1's, so its KV differs from TP = 1's by a bf16
ulp or two after the first layer: greedy tokens across the two degrees are
compared with the margin rule (``margins.py``: teacher-forced through
transformers), which refuses wrong KV (its companion tests are in
``test_hybrid_export.py``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import require
from engine_script import run_phases
from margins import assert_agrees
from prefetch import prefetched
from tiny_models import build_tiny_gemma3

from hurray_vllm.chunks import chunk_keys

pytestmark = [pytest.mark.vllm]
BLOCK, CHUNK, WINDOW = 32, 128, 64


def _prompt(seed: int, n: int) -> list[int]:
    return [(i * 37 + seed * 101 + 11) % 500 + 1 for i in range(n)]


P, V, S = _prompt(2, 300), _prompt(3, 300), _prompt(4, 300)
Q = [*P[:200], *_prompt(5, 60)]  # shares its first chunk with "p" (stored once)


def _run(tmp: Path, name: str, tp: int, phases: list[dict[str, Any]]) -> dict[str, Any]:
    return run_phases(tmp, name, tp, phases, block=BLOCK, chunk=CHUNK, max_model_len=1024)


@pytest.fixture(scope="session")
@prefetched
def hybrid_tp(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    require("transformers")
    require("vllm")
    tmp = tmp_path_factory.mktemp("hybrid-tp")
    build_tiny_gemma3(tmp / "model", window=WINDOW)
    runs: dict[str, Any] = {"tmp": tmp}
    # Unmoved: nothing stored yet, every token computed (and "p", "q", "v" saved whole).
    runs["save1"] = _run(tmp, "save1", 1, [{"prompts": {"p": P, "q": Q, "v": V, "s": S}}])
    runs["keys"] = {name: chunk_keys(p[: 2 * CHUNK], CHUNK, _namespace(tmp)) for name, p in (("s", S), ("v", V))}
    for key in runs["keys"]["s"]:  # "s" is for the TP = 2 engine to compute and save
        (tmp / "store" / _namespace(tmp) / f"{key}.hrry").unlink()
    runs["tp2"] = _run(
        tmp,
        "tp2",
        2,
        [{"prompts": {"p": P, "q": Q}}, {"prompts": {"v": V}, "vanish": True}, {"prompts": {"s": S}}],
    )
    runs["load1"] = _run(tmp, "load1", 1, [{"prompts": {"s": S, "v": V}}])
    return runs


@pytest.fixture(scope="session")
def hf_model(hybrid_tp: dict[str, Any]) -> Any:
    from transformers import Gemma3ForCausalLM

    return Gemma3ForCausalLM.from_pretrained(hybrid_tp["tmp"] / "model", dtype=torch.bfloat16).eval()


def _agrees(model: Any, outputs: dict[str, list[int]], what: str) -> None:
    """Each request's greedy tokens, teacher-forced through transformers from its prompt, pass the margin rule."""
    prompts = {"p": P, "q": Q, "v": V, "s": S}
    for rid, tokens in outputs.items():
        feed = torch.tensor([[*prompts[rid], *tokens[:-1]]])
        with torch.no_grad():
            logits = model(input_ids=feed).logits[0, len(prompts[rid]) - 1 :].float()
        assert_agrees(logits, tokens, f"hybrid TP {what} {rid}")


def _namespace(tmp: Path) -> str:
    (ns,) = [p.name for p in (tmp / "store").iterdir() if p.is_dir()]
    return ns


def test_the_unmoved_tp1_run_is_what_transformers_computes(hybrid_tp: dict[str, Any], hf_model: Any) -> None:
    unmoved = hybrid_tp["save1"]["phases"][0]["outputs"]
    _agrees(hf_model, unmoved, "1 unmoved")
    assert len(set(unmoved["s"])) > 3  # the tiny model's tokens vary: the comparisons mean something


def test_a_tp2_hybrid_loads_tp1_chunks(hybrid_tp: dict[str, Any], hf_model: Any) -> None:
    first = hybrid_tp["tp2"]["phases"][0]
    _agrees(hf_model, first["outputs"], "1 -> 2")
    assert first["cached"] == {"p": 2 * CHUNK, "q": 2 * CHUNK}  # every whole chunk
    assert hybrid_tp["tp2"]["hybrid_kv_cache_manager"]
    loaded = [w["chunks_loaded"] for w in hybrid_tp["tp2"]["worker_stats"]]
    assert loaded[0] == loaded[1] >= 3  # both ranks, their head each ("q" may hit "p"'s first chunk locally)


def test_a_chunk_file_gone_before_the_workers_read_it_is_recomputed_and_the_engine_goes_on(
    hybrid_tp: dict[str, Any], hf_model: Any
) -> None:
    run = hybrid_tp["tp2"]
    vanished = run["phases"][1]
    assert run["promised_then_vanished"] == 1  # the scheduler had verified and promised "v"'s chunks
    _agrees(hf_model, vanished["outputs"], "2 recomputed")
    assert vanished["cached"] == {"v": 0}  # recomputed from its first token
    assert run["scheduler_stats"]["loads_failed"] == 1
    assert [w["loads_failed"] for w in run["worker_stats"]] == [1, 1]
    # The engine went on: the next batch ran, and "v"'s recomputed chunks were saved again, as slices.
    keys = hybrid_tp["keys"]["v"]
    assert {f"{k}.h{h}-{h + 1}.hrry" for k in keys for h in (0, 1)} <= set(vanished["files"])


def test_tp2_hybrid_slices_load_into_a_tp1_engine(hybrid_tp: dict[str, Any], hf_model: Any) -> None:
    computed = hybrid_tp["tp2"]["phases"][2]
    files = set(computed["files"])
    assert {f"{k}.h{h}-{h + 1}.hrry" for k in hybrid_tp["keys"]["s"] for h in (0, 1)} <= files
    assert not {f"{k}.hrry" for k in hybrid_tp["keys"]["s"]} & files  # slices only, each with every group's part
    _agrees(hf_model, computed["outputs"], "2 unmoved")
    loaded = hybrid_tp["load1"]["phases"][0]
    _agrees(hf_model, loaded["outputs"], "2 -> 1")
    assert loaded["cached"] == {"s": 2 * CHUNK, "v": 2 * CHUNK}
