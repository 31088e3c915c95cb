"""HurrayConnector with vLLM's speculative decoding (n-gram drafts), between real engines on the CPU.

A speculative step also computes up to 4 draft tokens, which the request's
token ids do not hold yet and which the target model may reject. Before the
connector counted only the tokens a request holds, such a step "completed"
chunks past them and the scheduler failed with an ``IndexError``, stopping
the engine. Now a chunk is saved once every token of it is final: its KV is
the target model's for those tokens, prompt and generated alike.

The prompts repeat a pattern, so the n-gram proposer drafts from the first
decode step on.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from conftest import require
from margins import assert_agrees
from servers import run_engine
from tiny_models import build_tiny_llama

from hurray_vllm.chunks import chunk_keys

pytestmark = [pytest.mark.vllm]
BLOCK = CHUNK = 32
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 2}
P = [(i * 37 + 11) % 50 + 1 for i in range(20)] * 5  # 100 tokens
Q = [(i * 13 + 5) % 40 + 1 for i in range(15)] * 6  # 90 tokens
MAX_TOKENS, MOVED_AFTER = 60, 30  # "p" moved after 30 tokens: its prompt ends at 130, past a decode chunk


@pytest.fixture(scope="module")
def spec_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    require("vllm")
    require("transformers")
    tmp = tmp_path_factory.mktemp("speculative")
    build_tiny_llama(tmp / "model")
    extra = {"hurray_path": str(tmp / "store"), "hurray_chunk_tokens": CHUNK}
    prompts = {"p": P, "q": Q}
    runs: dict[str, Any] = {"tmp": tmp, "store": tmp / "store"}
    runs["plain"] = run_engine(tmp, "plain", BLOCK, None, prompts, MAX_TOKENS, speculative=SPEC)
    runs["producer"] = run_engine(tmp, "producer", BLOCK, extra, prompts, MAX_TOKENS, speculative=SPEC)
    moved = [*P, *runs["producer"]["outputs"]["p"][:MOVED_AFTER]]
    runs["moved"] = moved
    budget = {"p": MAX_TOKENS, "q": MAX_TOKENS, "p_moved": MAX_TOKENS - MOVED_AFTER}
    runs["consumer"] = run_engine(
        tmp, "consumer", BLOCK, extra, {**prompts, "p_moved": moved}, budget, speculative=SPEC
    )
    return runs


def test_a_producer_drafting_tokens_saves_every_chunk_its_final_tokens_complete(spec_runs: dict[str, Any]) -> None:
    plain, producer = spec_runs["plain"], spec_runs["producer"]
    assert producer["outputs"] == plain["outputs"]  # saving changes nothing the engine computes
    assert len(set(plain["outputs"]["p"])) > 3  # the tiny model's tokens vary: the comparisons mean something
    store = spec_runs["store"]
    (ns,) = [d.name for d in store.iterdir() if d.is_dir()]
    for rid, prompt in (("p", P), ("q", Q)):
        tokens = [*prompt, *producer["outputs"][rid]]
        # Every whole chunk of the tokens whose KV was computed (all but the last generated one),
        # those that decode steps (with drafts) completed included.
        keys = chunk_keys(tokens[: len(tokens) - 1], CHUNK, ns)
        assert len(keys) > len(prompt) // CHUNK
        assert all((store / ns / f"{k}.hrry").exists() for k in keys), rid


def test_a_consumer_drafting_tokens_loads_them_with_identical_tokens(spec_runs: dict[str, Any]) -> None:
    plain, consumer = spec_runs["plain"], spec_runs["consumer"]
    assert {rid: consumer["outputs"][rid] for rid in ("p", "q")} == plain["outputs"]
    assert consumer["cached"]["p"] == 96 and consumer["cached"]["q"] == 64  # every whole chunk (tails: none fit)


def test_a_request_moved_mid_decode_loads_the_chunks_speculative_steps_completed(
    spec_runs: dict[str, Any],
) -> None:
    """ "p" moved after 30 tokens: the chunk 96..128 holds 28 generated tokens, saved by steps that drafted."""
    from transformers import LlamaForCausalLM

    consumer, moved = spec_runs["consumer"], spec_runs["moved"]
    assert consumer["cached"]["p_moved"] == 128
    tokens = consumer["outputs"]["p_moved"]
    want = spec_runs["plain"]["outputs"]["p"][MOVED_AFTER:]
    if tokens != want:  # the tail was computed in another batch shape than the unmoved run's decode steps
        model = LlamaForCausalLM.from_pretrained(spec_runs["tmp"] / "model", dtype=torch.bfloat16).eval()
        with torch.no_grad():
            logits = model(torch.tensor([moved + tokens[:-1]])).logits[0, len(moved) - 1 :].float()
        assert_agrees(logits, tokens, "speculative p moved after 30 tokens")
