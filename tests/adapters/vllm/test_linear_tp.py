"""A linear-attention hybrid (Qwen3-Next style) between real vLLM engines at TP = 1 and TP > 1 (CPU, one core per rank).

vLLM splits every gated-delta-net state over the ranks (a share of the
conv channels and of the value heads each) and the KV heads too, or
replicates a KV head over several ranks where there are fewer KV heads
than ranks. A chunk saved at TP > 1 is a slice per KV head, each with its
heads' share of the states (which the rank saving it gathers from the
ranks that replicate its heads); a TP = 1 engine joins them, a TP > 1
engine cuts its rank's share out of a whole chunk. Two cases
(``CASES``): 2 KV heads at TP = 2, and Qwen3-Next's own layout at TP = 4
(2 KV heads, each on two ranks; the states over four: the rank saving a
head's slice gathers its replica's share). One KV head at TP = 2 (saved
whole by one rank, with both ranks' shares) is covered without an engine
(``test_tp_replicas.py``, ``test_state_shares.py``). Three engines per case:

1. TP = 1 computes "p", "v", "s" (saving every chunk; "s"'s are deleted
   afterwards) and snapshots them after their prefill;
2. the multi-rank engine loads "p"; loads "v" while a racing prune deletes
   its chunk files after the scheduler promised them (the workers, processes
   of their own, cannot read them: the load fails through vLLM's
   asynchronous path, the request is recomputed and the engine goes on);
   computes and saves "s", and snapshots it after its prefill;
3. TP = 1 loads "s" and "v" from the multi-rank engine's slices.

vLLM sizes this model's blocks to its states (640 tokens on this CPU, 384
on others; 1152 with one KV head or twice the state heads): prompts are
laid out in blocks ``B``, each one or two whole chunks and 40 more tokens.
A multi-rank engine's all-reduces sum in another order than TP = 1's, so
tokens across the degrees are compared with the margin rule
(``margins.py``, teacher-forced through transformers), which refuses wrong
states (``test_linear_attention.py`` shows it with zeroed states).
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
from servers import side_by_side
from tiny_models import build_tiny_qwen3_next

import hurray_vllm as hv
from hurray_vllm.chunks import chunk_keys

pytestmark = [pytest.mark.vllm]
SEEDS = {"p": 2, "v": 3, "s": 4}


def _run(tmp: Path, name: str, tp: int, phases: list[dict[str, Any]], block: int | None = None) -> dict[str, Any]:
    return run_phases(tmp, name, tp, phases, block=block)


def _namespace(tmp: Path) -> str:
    (ns,) = [p.name for p in (tmp / "store").iterdir() if p.is_dir()]
    return ns


def _files(keys: list[str], kv_heads: int) -> set[str]:
    """The files of chunks saved at TP > 1: a slice per KV head."""
    return {f"{k}.h{h}-{h + 1}.hrry" for k in keys for h in range(kv_heads)}


#: The configurations: KV heads, ranks, the gated delta nets' key and value heads, experts per token.
CASES = {
    "kv2-tp2": (2, 2, (2, 4), 2),  # one KV head and half of every state per rank
    "kv2-tp4": (2, 4, (4, 8), 4),  # Qwen3-Next's layout at TP = 4: each KV head on two ranks, states over four
}


def _save1(tmp: Path, case: str) -> dict[str, Any]:
    """The case's model; a TP = 1 engine computes and saves "p", "v", "s"; "s"'s files are deleted again."""
    kv, tp, heads, experts = CASES[case]
    build_tiny_qwen3_next(tmp / "model", kv_heads=kv, experts_per_token=experts, linear_heads=heads)
    # vLLM sizes blocks to the states per rank and the KV per token: with one KV head (or twice the state
    # heads) a TP = 1 block is 1152 tokens here, and more ranks (a smaller share) would pick fewer. The
    # multi-rank engine is told TP = 1's.
    blocks = 2 if (kv, heads) == (2, (2, 4)) else 1  # whole chunks (of a block each), within max_model_len 2048
    specs = {rid: {"seed": seed, "blocks": blocks, "extra": 40} for rid, seed in SEEDS.items()}
    runs: dict[str, Any] = {"tmp": tmp, "kv": kv, "tp": tp, "heads": heads, "blocks": blocks, "specs": specs}
    runs["save1"] = _run(tmp, "save1", 1, [{"prompts": specs, "snapshot": True}])
    block = runs["save1"]["block_size"]
    prompts = runs["save1"]["prompts"]
    ns = _namespace(tmp)
    runs["keys"] = {rid: chunk_keys(prompts[rid][: blocks * block], block, ns) for rid in specs}
    for key in runs["keys"]["s"]:  # "s" is for the multi-rank engine to compute and save
        (tmp / "store" / ns / f"{key}.hrry").unlink()
    return runs


def _ranks(runs: dict[str, Any]) -> dict[str, Any]:
    """The multi-rank engine: loads "p"; "v" while a racing prune deletes its files; computes and saves "s"."""
    tmp, specs, block = runs["tmp"], runs["specs"], runs["save1"]["block_size"]
    phases = [
        {"prompts": {"p": specs["p"]}},
        {"prompts": {"v": specs["v"]}, "vanish": True},
        {"prompts": {"s": specs["s"]}, "snapshot": True},
    ]
    out = _run(tmp, "ranks", runs["tp"], phases, block=block)
    assert out["block_size"] == block  # else chunks of the two degrees would not be the same
    return out


def _load1(runs: dict[str, Any]) -> dict[str, Any]:
    """A TP = 1 engine loads "s" and "v" from the multi-rank engine's slices."""
    specs = runs["specs"]
    return _run(runs["tmp"], "load1", 1, [{"prompts": {"s": specs["s"], "v": specs["v"]}}])


@pytest.fixture(scope="session")
@prefetched
def linear_cases(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """Every case's three engines, a TP = 1 run beside a multi-rank one where they share nothing.

    Two multi-rank engines never run together: their ranks are bound to the
    same cores (``servers.side_by_side``).
    """
    require("transformers")
    require("vllm")
    tmps = {case: tmp_path_factory.mktemp(f"linear-{case}") for case in CASES}
    a, b = CASES  # kv2-tp2, kv2-tp4
    runs = side_by_side({a: lambda: _save1(tmps[a], a), b: lambda: _save1(tmps[b], b)})
    runs[a]["ranks"] = _ranks(runs[a])
    stage = side_by_side({"ranks": lambda: _ranks(runs[b]), "load1": lambda: _load1(runs[a])})
    runs[b]["ranks"], runs[a]["load1"] = stage["ranks"], stage["load1"]
    runs[b]["load1"] = _load1(runs[b])
    return runs


@pytest.fixture(scope="session", params=list(CASES), ids=list(CASES))
def linear_tp(linear_cases: dict[str, dict[str, Any]], request: pytest.FixtureRequest) -> dict[str, Any]:
    """A TP = 1 engine saves, an engine of ``tp`` ranks loads and saves, a TP = 1 engine loads its chunks.

    Every token goes to every expert where the ranks split states finer than
    KV heads: with top-2 routing a router near-tie flips an expert on TP's
    summation order, and the engine's own unmoved tokens then leave
    transformers' margin (vLLM's arithmetic, not a transfer).
    """
    return linear_cases[request.param]


@pytest.fixture(scope="session")
def hf_model(linear_tp: dict[str, Any]) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(linear_tp["tmp"] / "model", dtype=torch.bfloat16).eval()


def _agrees(model: Any, run: dict[str, Any], outputs: dict[str, list[int]], what: str) -> None:
    """Each request's greedy tokens, teacher-forced through transformers from its prompt, pass the margin rule."""
    for rid, tokens in outputs.items():
        prompt = run["prompts"][rid]
        feed = torch.tensor([[*prompt, *tokens[:-1]]])
        with torch.no_grad():
            logits = model(input_ids=feed).logits[0, len(prompt) - 1 :].float()
        assert_agrees(logits, tokens, f"linear TP {what} {rid}")


def test_a_multi_rank_engine_loads_whole_tp1_chunks(linear_tp: dict[str, Any], hf_model: Any) -> None:
    run = linear_tp["ranks"]
    first = run["phases"][0]
    block = run["block_size"]
    _agrees(hf_model, run, first["outputs"], f"1 -> {linear_tp['tp']}")
    blocks = linear_tp["blocks"]
    assert first["cached"] == {"p": blocks * block}  # every chunk: the last holds the states taken at its end
    assert run["hybrid_kv_cache_manager"]
    assert [w["chunks_loaded"] for w in run["worker_stats"]] == [blocks] * linear_tp["tp"]  # each rank its share


def test_a_multi_rank_load_whose_files_vanish_is_recomputed_and_the_engine_goes_on(
    linear_tp: dict[str, Any], hf_model: Any
) -> None:
    run = linear_tp["ranks"]
    vanished = run["phases"][1]
    assert run["promised_then_vanished"] == 1
    _agrees(hf_model, run, vanished["outputs"], f"{linear_tp['tp']} recomputed")
    assert vanished["cached"] == {"v": 0}
    assert run["scheduler_stats"]["loads_failed"] == 1
    assert [w["loads_failed"] for w in run["worker_stats"]] == [1] * linear_tp["tp"]
    assert _files(linear_tp["keys"]["v"], linear_tp["kv"]) <= set(vanished["files"])


def test_slices_carry_their_heads_share_of_the_states_and_load_into_tp1(
    linear_tp: dict[str, Any], hf_model: Any, hurray: Any
) -> None:
    tmp, run = linear_tp["tmp"], linear_tp["ranks"]
    block = run["block_size"]
    computed = run["phases"][2]
    _agrees(hf_model, run, computed["outputs"], f"{linear_tp['tp']} unmoved")
    keys, kv = linear_tp["keys"]["s"], linear_tp["kv"]
    files = set(computed["files"])
    assert _files(keys, kv) <= files
    assert not {f"{k}.hrry" for k in keys} & files
    store = tmp / "store" / _namespace(tmp)
    # The last whole chunk holds the states taken at its end: each slice its heads' share (at TP = 4 the rank
    # saving it gathered its replica's).
    for name in sorted(_files(keys[-1:], kv)):
        h = int(name.split(".h")[1].split("-")[0])
        part = hv.load(store / name)
        assert part.states is not None and part.states.positions == (len(keys) * block,)
        assert part.states.part == (h, h + 1, 2)
        k_heads, v_heads = linear_tp["heads"]
        conv = (2 * k_heads + v_heads) * 128 // kv  # the file's heads' share of q, k and v channels
        value_heads = v_heads // kv
        assert part.states.shapes == ((3, conv), (value_heads, 128, 128))
        assert hv.validate(store / name).ok
        ref = hurray.load(str(store / name))  # the reference reads a share as any state
        assert [tuple(m.shape) for m in ref["states.0"].members] == [(1, 3, conv), (1, value_heads, 128, 128)]
    loaded = linear_tp["load1"]["phases"][0]
    _agrees(hf_model, linear_tp["load1"], loaded["outputs"], f"{linear_tp['tp']} -> 1")
    assert loaded["cached"] == {"s": len(keys) * block, "v": len(keys) * block}


def _close(got: torch.Tensor, want: torch.Tensor, atol: float, what: str) -> None:
    """Within what three layers of all-reduces summed in another order give here (~1% of the values, measured)."""
    torch.testing.assert_close(got.float(), want.float(), rtol=0.05, atol=atol, msg=what)


def test_a_multi_rank_snapshot_holds_every_head_and_the_whole_states_of_tp1(linear_tp: dict[str, Any]) -> None:
    """The multi-rank snapshot of "s" after its prefill equals TP = 1's.

    The first state layer bit for bit (no all-reduce before it), the rest within the all-reduces' other
    summation order; the tolerance still refuses one rank's share in the other's place.
    """
    tp1 = hv.load(linear_tp["save1"]["dir"] / "snap0.hrry").select([2])  # "p", "v", "s" in that order
    tpn = hv.load(linear_tp["ranks"]["dir"] / "snap2.hrry")
    assert tpn.heads is None and tpn.token_ids == tp1.token_ids and tpn.seq_lens == tp1.seq_lens
    a, b = tp1.states, tpn.states
    assert a is not None and b is not None and b.part is None and not a.mismatches(b)
    assert a.positions == b.positions == (tp1.seq_lens[0],)
    for j, (la, lb) in enumerate(zip(a.tensors, b.tensors, strict=True)):
        for name, x, y in zip(a.names, la, lb, strict=True):
            if j == 0:
                assert torch.equal(x, y), f"state layer 0 {name}"
            else:
                _close(y, x, 0.1, f"state {j} {name}")
    for i in range(tp1.num_layers):
        for x, y in zip(tp1.layer(i), tpn.layer(i), strict=True):
            assert x.num_heads == y.num_heads == linear_tp["kv"]
            _close(y.page_pool, x.page_pool, 0.3, f"layer {i} {x.kv_role}")
    # The shares swapped (the second rank's value heads first; its KV head first) are far outside.
    ssm, half = b.tensors[2][1], b.tensors[2][1].shape[1] // 2
    with pytest.raises(AssertionError):
        _close(torch.cat([ssm[:, half:], ssm[:, :half]], dim=1), a.tensors[2][1], 0.1, "swapped")
    pool = tpn.layer(0)[0].page_pool
    with pytest.raises(AssertionError):
        _close(pool.flip(2), tp1.layer(0)[0].page_pool, 0.3, "swapped")
