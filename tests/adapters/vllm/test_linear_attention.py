"""Linear-attention hybrids (Qwen3-Next style, gated delta net) from real vLLM engines, against transformers.

One engine saves (HurrayConnector, prefix caching on: ``mamba_cache_mode
"align"``) and snapshots after the prefill and one decode step later;
another loads the chunks; a third loads from a store where one chunk lost
its states and another's states are damaged; a fourth from a store whose
states were replaced by noise (well-formed, re-digested), which shows that
the token comparison notices wrong states.

Two variants of vLLM's state memory, one engine each, whose states are
compared by value (the CPU backend takes head dims of 128 only, so a
transposed recurrent state has the shape of the right one and passes every
shape check): ``mamba_ssm_cache_dtype="bfloat16"`` (vLLM keeps a 16-bit SSM
state for its accelerated GDN backend on CPUs with avx512_bf16, which reset
the default to float32; the run says which it kept), saving, snapshotting
and resuming a moved request from its own chunks; and the "DS" conv-state
layout (``VLLM_SSM_CONV_STATE_LAYOUT=DS``: ``[conv_dim, kernel - 1]`` per
block), loading the default ("SD") engine's chunks and snapshotting.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import ISAS_SEEN, require
from engine_script import run_engine_script
from margins import agreement, assert_agrees, assert_continues
from prefetch import prefetched
from servers import side_by_side
from synthetic import save_unchecked
from tiny_models import build_tiny_qwen3_next

import hurray_vllm as hv
from hurray_vllm.adapters import transformers as tfa
from hurray_vllm.chunks import chunk_keys
from hurray_vllm.chunks.store import DIGEST_KEY, chunk_digest

pytestmark = [pytest.mark.vllm]
HERE = Path(__file__).resolve().parents[2]
MOVED_AFTER = 9  # tokens "d" generated before it "moves" to another engine (its prompt is 2B - 8 tokens)


def state_bytes(recurrent_element_size: int) -> int:
    """Bytes of one sequence's states in the tiny model: 3 layers x (conv 3 x 1024 bf16 + recurrent 4 x 128 x 128).

    vLLM keeps the recurrent state in bf16 on some CPUs (AVX2) and in float32 on others (AVX-512).
    """
    return 3 * (3 * 1024 * 2 + 4 * 128 * 128 * recurrent_element_size)


def _run(
    tmp: Path,
    name: str,
    store: Path,
    mode: str,
    more: Path | None = None,
    *,
    flags: Sequence[str] = (),
    env: dict[str, str] | None = None,
) -> dict[str, Any]:
    args = [str(tmp / "model"), str(tmp / name), str(store), mode, *([str(more)] if more else []), *flags]
    return run_engine_script("linear_engine_run.py", args, tmp / name, f"linear-attention engine {name}", env=env)


def _chunk_path(store: Path, prompt: list[int], chunk: int, index: int) -> Path:
    (ns,) = [p.name for p in store.iterdir()]
    return store / ns / f"{chunk_keys(prompt[: (index + 1) * chunk], chunk, ns)[index]}.hrry"


def _rewrite(path: Path, states: Any, *, redigest: bool = True) -> None:
    """Store the chunk at ``path`` again with other ``states`` (and, unless told otherwise, a matching digest).

    Without one it is a damaged chunk, which ``hv.save`` refuses to write (``load`` would refuse it): written
    unchecked, as a disk or a transfer would leave it.
    """
    snap = replace(hv.load(path), states=states)
    if not redigest:
        save_unchecked(snap, path)
        return
    hv.save(replace(snap, extra={**snap.extra, DIGEST_KEY: chunk_digest(snap)}), path)


def _linear_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    require("transformers")
    require("vllm")
    tmp = tmp_path_factory.mktemp("linear")
    build_tiny_qwen3_next(tmp / "model")
    store = tmp / "store"
    saved = _run(tmp, "save", store, "save")
    prompts, chunk = saved["prompts"], saved["chunk_tokens"]
    runs: dict[str, Any] = {"tmp": tmp, "store": store, "save": saved}
    runs["prefill"] = hv.load(saved["dir"] / "prefill.hrry")
    runs["snap"] = hv.load(saved["dir"] / "snap.hrry")
    broken, forged = tmp / "broken-store", tmp / "forged-store"
    shutil.copytree(store, broken)
    shutil.copytree(store, forged)
    # "a" resumes at 2B from chunk 1's states: without them it has no resume (chunk 0 holds none).
    _rewrite(_chunk_path(broken, prompts["a"], chunk, 1), None)
    # "d" resumes at B from chunk 0's states: one value changed, the digest left as it was.
    d0 = _chunk_path(broken, prompts["d"], chunk, 0)
    states = hv.load(d0).states
    assert states is not None
    states.tensors[1][1][0, 0, 0, 0] += 1
    _rewrite(d0, states, redigest=False)
    runs["d0"] = d0
    real = hv.load(_chunk_path(forged, prompts["a"], chunk, 1)).states
    assert real is not None
    # Noise of four times the real states' spread: well-formed, plausible in scale, and wrong. (Zeroed states
    # left this tiny model's greedy tokens as they were on an AVX-512 machine: too weak a forgery to show.)
    gen = torch.Generator().manual_seed(0)
    noise = [
        [(torch.randn(t.shape, generator=gen) * 4 * t.float().std()).to(t.dtype) for t in layer]
        for layer in real.tensors
    ]
    _rewrite(_chunk_path(forged, prompts["a"], chunk, 1), real.with_tensors(noise))
    # A migration of "d" after 9 generated tokens: its prompt is "d"'s and those tokens, whose chunk 1 was
    # completed by the 8th decode step, which took the states at its end.
    moved = tmp / "moved.json"
    moved.write_text(json.dumps({"d_moved": [*prompts["d"], *saved["outputs"]["d"][:MOVED_AFTER]]}))
    runs |= side_by_side(
        {
            "load": lambda: _run(tmp, "load", store, "load", moved),
            "broken": lambda: _run(tmp, "broken", broken, "load"),
            "forged": lambda: _run(tmp, "forged", forged, "load"),
        }
    )
    return runs


#: The default engine's runs; ``linear_ds`` (which loads their store) calls it too, and gets the same runs.
_linear_job = prefetched(_linear_runs)
linear = pytest.fixture(scope="session", name="linear")(_linear_job)

#: The SSM state dtype the bf16 variant asks vLLM for (``mamba_ssm_cache_dtype``).
SSM_DTYPE = "bfloat16"


@pytest.fixture(scope="session")
@prefetched
def linear_bf16(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One engine with ``mamba_ssm_cache_dtype="bfloat16"``: saves, snapshots, then resumes "d" moved from its chunks.

    Its own model (the same seeded weights) and store: an engine refuses chunks of another state dtype (their
    declared layouts differ), so it could not resume from the default engine's float32 ones.
    """
    require("transformers")
    require("vllm")
    tmp = tmp_path_factory.mktemp("linear-bf16")
    build_tiny_qwen3_next(tmp / "model")
    store = tmp / "store"
    saved = _run(tmp, "save", store, "save", flags=["--ssm-dtype", SSM_DTYPE, "--move-after", str(MOVED_AFTER)])
    return {
        "tmp": tmp,
        "store": store,
        "save": saved,
        "prefill": hv.load(saved["dir"] / "prefill.hrry"),
        "snap": hv.load(saved["dir"] / "snap.hrry"),
    }


@pytest.fixture(scope="session")
@prefetched
def linear_ds(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One engine with the DS conv-state layout, on a copy of the default engine's store (saved in "SD").

    It runs the prompts and "d" moved of the default ``load`` run, and snapshots as the saving run does.
    """
    runs = _linear_job(tmp_path_factory)
    tmp = runs["tmp"]
    store = tmp / "ds-store"
    shutil.copytree(runs["store"], store)
    env = {"VLLM_SSM_CONV_STATE_LAYOUT": "DS"}
    ds = _run(tmp, "ds", store, "load", tmp / "moved.json", flags=["--snapshot"], env=env)
    return {"run": ds, "prefill": hv.load(ds["dir"] / "prefill.hrry"), "snap": hv.load(ds["dir"] / "snap.hrry")}


def _hf_model(path: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()


@pytest.fixture(scope="module")
def hf_qwen3_next(linear: dict[str, Any]) -> Any:
    return _hf_model(linear["tmp"] / "model")


def _hf_states(model: Any, ids: list[int]) -> tuple[Any, list[tuple[torch.Tensor, torch.Tensor]]]:
    """transformers' cache after a prefill of ``ids``, and its states in vLLM's layout (conv ``[kernel - 1, C]``)."""
    with torch.no_grad():
        cache = model(torch.tensor([ids]), use_cache=True).past_key_values
    states = [
        (cache.layers[j].conv_states[0][0][:, 1:].T.float(), cache.layers[j].recurrent_states[0][0].float())
        for j in (0, 1, 2)
    ]
    return cache, states


def _rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got.float() - ref).norm() / ref.norm())


#: Relative (Frobenius) error of vLLM's states against transformers': at most 0.09 seen (two arithmetics,
#: bf16 states, AVX2; the same with mamba_ssm_cache_dtype="bfloat16" on avx512_bf16, where float32 states are
#: off by at most 0.05; conv states are exact); the states one token earlier are off by more than 1, and a
#: transposed recurrent state by about 1.4.
STATE_TOLERANCE = 0.2


def test_the_engine_keeps_its_hybrid_manager_with_prefix_caching(linear: dict[str, Any]) -> None:
    saved = linear["save"]
    assert saved["hybrid_manager_off"] is False
    assert saved["prefix_caching"] is True and saved["mamba_cache_mode"] == "align"
    # vLLM sizes the blocks to the states' page: 384 tokens with AVX2, 640 with AVX-512 (one chunk each).
    assert saved["block_size"] == saved["chunk_tokens"] >= 256


def test_chunks_carry_states_only_where_they_were_taken(linear: dict[str, Any]) -> None:
    store, prompts, chunk = linear["store"], linear["save"]["prompts"], linear["save"]["chunk_tokens"]
    outputs, b = linear["save"]["outputs"], linear["save"]["chunk_tokens"]
    expect = {
        # "a" completed it inside its first prefill step (0..2B), without a state at B; "e" in a step
        # ending there, with one: the chunk with states is the one stored.
        ("a", 0): b,
        ("a", 1): 2 * b,
        ("d", 0): b,
        ("d", 1): 2 * b,  # the chunk completed by the 8th decode step, which ended there
        ("c", 0): None,  # shorter than a chunk: nothing stored
    }
    for (rid, c), where in expect.items():
        tokens = prompts[rid] + outputs[rid]
        if where is None:
            assert len(tokens) < chunk
            continue
        snap = hv.load(_chunk_path(store, tokens, chunk, c))
        assert snap.states is not None and snap.states.positions == (where,), f"{rid} chunk {c}"
        assert snap.states.layers == (0, 1, 2) and snap.states.names == ("conv", "ssm")
        conv, recurrent = snap.states.tensors[0]
        assert conv.dtype == torch.bfloat16 and recurrent.dtype in (torch.bfloat16, torch.float32)
        assert snap.states.kind == "gdn_attn" and snap.states.nbytes == state_bytes(recurrent.element_size())
        assert hv.validate(_chunk_path(store, tokens, chunk, c)).ok


def _assert_states_match(runs: dict[str, Any], model: Any, what: str) -> None:
    """Both snapshots (prefill, a decode step later): each state within bf16 of transformers', not of a neighbour's.

    A value comparison: the recurrent state is ``[v_heads, 128, 128]`` either way round (vLLM's CPU kernels take
    head dims of 128 only), so a transposed state would pass every shape check; it is off by about 1.4.
    """
    for name in ("prefill", "snap"):
        snap = runs[name]
        assert snap.states is not None and snap.states.positions == tuple(snap.seq_lens)
        for s, rid in enumerate(snap.request_ids):
            n = snap.seq_lens[s]
            ids = list(snap.token_ids[s][:n])
            _, want = _hf_states(model, ids)
            _, before = _hf_states(model, ids[:-1])
            for j in range(3):
                for m, role in enumerate(("conv", "ssm")):
                    got = snap.states.tensors[j][m][s]
                    where = f"{what} {name} {rid} layer {j} {role} ({got.dtype})"
                    assert _rel(got, want[j][m]) <= STATE_TOLERANCE, where
                    # The companion: the tolerance refuses the state one token earlier.
                    assert _rel(got, before[j][m]) > 3 * STATE_TOLERANCE, where


def test_snapshot_states_equal_transformers(linear: dict[str, Any], hf_qwen3_next: Any) -> None:
    """After the prefill and after a decode step: each state within bf16 of transformers', and not of a neighbour's."""
    _assert_states_match(linear, hf_qwen3_next, "default")


def test_snapshot_attention_kv_equals_transformers(linear: dict[str, Any], hf_qwen3_next: Any) -> None:
    """The one full-attention layer (model layer 3) is the snapshot's layer 0."""
    snap = linear["snap"]
    assert snap.states is not None and snap.states.attention_layers(snap.num_layers) == [3]
    for s in range(snap.num_seqs):
        n = snap.seq_lens[s]
        cache, _ = _hf_states(hf_qwen3_next, list(snap.token_ids[s][:n]))
        for role, ref in (("key", cache.layers[3].keys), ("value", cache.layers[3].values)):
            got = snap[0, role].to_dense(s).float()  # [n, H, D]
            want = ref[0].transpose(0, 1).float()
            assert _close(got, want), f"seq {s} {role}"
            assert not _close(got[1:], want[:-1]), f"seq {s} {role}: the neighbour's KV passed"


#: How far the attention layer's K/V may be from transformers' (relative norm per token and head).
KV_TOLERANCE = 0.35


def _close(got: torch.Tensor, ref: torch.Tensor) -> bool:
    """Every token's and head's vector within :data:`KV_TOLERANCE` of transformers' (relative norm).

    The inputs of this layer went through three linear-attention layers whose
    recurrent state vLLM keeps in bf16 (AVX2: at most 0.08 seen over 1000
    tokens) or float32 (AVX-512: at most 0.25 over 1500 tokens, 0.1 at the
    99th percentile), transformers in bf16. A neighbour's vector is off by
    more than 0.95 on both: the companion assertion refuses it.
    """
    return bool(((got - ref).norm(dim=-1) <= KV_TOLERANCE * ref.norm(dim=-1)).all())


def test_transformers_continues_from_the_snapshot(linear: dict[str, Any], hf_qwen3_next: Any) -> None:
    """transformers resumed from vLLM's KV and states goes on as vLLM did (margin rule: two arithmetics)."""
    snap, result = linear["snap"], linear["save"]
    for s, rid in enumerate(snap.request_ids):
        prompt, tokens = result["prompts"][rid], result["outputs"][rid]
        done = len(snap.token_ids[s]) - len(prompt)
        assert list(snap.token_ids[s]) == prompt + tokens[:done]
        logits = tfa.teacher_forced_logits(hf_qwen3_next, snap, s, tokens[done:])
        assert_agrees(logits, tokens[done:], f"linear {rid}: transformers from vLLM's KV and states")
    assert len(set(result["outputs"]["a"])) > 3  # the tiny model's tokens vary: the comparison means something


def test_the_margin_rule_refuses_zeroed_states(linear: dict[str, Any], hf_qwen3_next: Any) -> None:
    """The companion of the relaxed comparison: the same KV with empty states, and it is refused."""
    snap, result = linear["snap"], linear["save"]
    states = snap.states
    assert states is not None
    wrong = replace(snap, states=states.with_tensors([[torch.zeros_like(t) for t in lay] for lay in states.tensors]))
    s = snap.request_ids.index("a")
    done = len(snap.token_ids[s]) - len(result["prompts"]["a"])
    tokens = result["outputs"]["a"][done:]
    assert not agreement(tfa.teacher_forced_logits(hf_qwen3_next, wrong, s, tokens), tokens).ok


def test_states_resume_only_where_they_were_taken(linear: dict[str, Any], hf_qwen3_next: Any) -> None:
    snap = linear["snap"]
    with pytest.raises(hv.HurrayFormatError, match=r"snapshot\.states"):
        tfa.to_dynamic_cache(snap, 0, model_config=hf_qwen3_next.config, length=snap.seq_lens[0] - 1)
    # Another model's layers (all attention) cannot take them either.
    with pytest.raises(hv.HurrayFormatError, match="states"):
        tfa.check_compatible(replace(snap, states=None), hf_qwen3_next.config)


def test_from_transformers_refuses_a_linear_attention_cache(linear: dict[str, Any], hf_qwen3_next: Any) -> None:
    cache, _ = _hf_states(hf_qwen3_next, [1, 2, 3])
    with pytest.raises(hv.HurrayFormatError, match="linear-attention layer"):
        tfa.from_transformers(cache, [[1, 2, 3]], model_config=hf_qwen3_next.config)


def test_another_engine_loads_the_chunks_with_identical_tokens(linear: dict[str, Any]) -> None:
    saved, loaded = linear["save"], linear["load"]
    b = saved["chunk_tokens"]
    assert {rid: loaded["outputs"][rid] for rid in saved["outputs"]} == saved["outputs"]
    assert loaded["cached"]["a"] == 2 * b and loaded["cached"]["d"] == b  # resumed at their last states
    assert loaded["cached"]["e"] == b  # the chunk it shares with "a", whose states are its own
    work = loaded["worker_stats"]
    assert work["tokens_loaded"] >= 3 * b  # "b" and "e" may take the shared chunks from the engine's cache
    assert loaded["hybrid_manager_off"] is False


def test_a_request_moved_mid_decode_resumes_from_states_a_decode_step_took(linear: dict[str, Any]) -> None:
    """Migration: "d" continued on another engine after 9 tokens loads both chunks, chunk 1 with its decode states."""
    saved, loaded = linear["save"], linear["load"]
    b = saved["chunk_tokens"]
    assert loaded["cached"]["d_moved"] == 2 * b  # resumed at the state the 8th decode step took
    rest = saved["outputs"]["d"][MOVED_AFTER:]
    assert loaded["outputs"]["d_moved"][: len(rest)] == rest  # the unmoved run's continuation, token for token


def test_a_chunk_without_its_states_or_with_damaged_ones_is_recomputed(linear: dict[str, Any]) -> None:
    saved, broken = linear["save"], linear["broken"]
    assert broken["outputs"] == saved["outputs"]
    assert broken["cached"]["a"] == saved["chunk_tokens"]  # chunk 1 lost its states: "a" resumes at chunk 0's
    assert broken["cached"]["d"] == 0  # chunk 0's states fail the digest
    sched = broken["scheduler_stats"]
    assert sched["chunks_refused"] >= 1 and sched["chunks_quarantined"] == 1
    assert Path(str(linear["d0"]) + ".bad").exists()


def test_the_token_comparison_notices_wrong_states(linear: dict[str, Any]) -> None:
    """Forged states in a well-formed chunk load (nothing can tell them from real ones) and change the tokens."""
    saved, forged = linear["save"], linear["forged"]
    assert forged["cached"]["a"] == forged["cached"]["b"] == 2 * saved["chunk_tokens"]
    # "b" resumes with one prompt token left: its tokens follow from the states. ("a" computes 232 more prompt
    # tokens first, by which time this tiny model has forgotten them: its tokens may stay as they were.)
    assert forged["outputs"]["b"] != saved["outputs"]["b"]


def test_files_validate_and_pyhurray_reads_them(linear: dict[str, Any], hurray: Any) -> None:
    path = linear["save"]["dir"] / "snap.hrry"
    assert hv.validate(path).ok
    ref = hurray.load(str(path))
    n = linear["snap"].num_seqs
    assert [tuple(m.shape) for m in ref["states.0"].members] == [(n, 3, 1024), (n, 4, 128, 128)]
    for ext in ("hrrs", "safetensors"):
        other = linear["tmp"] / f"snap.{ext}"
        hv.save(linear["snap"], other)
        back = hv.load(other)
        assert back.states is not None
        for x, y in zip(back.states.tensors, linear["snap"].states.tensors, strict=True):
            assert all(torch.equal(a, b) for a, b in zip(x, y, strict=True))


# ── variants of vLLM's state memory: a bf16 SSM state, the DS conv-state layout ──


def _kept_dtype(run: dict[str, Any]) -> str:
    """The SSM state dtype vLLM kept (its config and the worker's tensors agree), recorded for the run's summary."""
    kept = run["mamba_ssm_cache_dtype"]
    layers = run["engine_states"]["layers"]
    assert len(layers) == 3 and {ssm[1] for _, ssm in layers.values()} == {kept}, layers
    return str(kept)


def test_bf16_ssm_state_is_what_the_engine_kept_and_the_chunks_carry(linear_bf16: dict[str, Any]) -> None:
    """vLLM keeps a bf16 SSM state (avx512_bf16: the accelerated GDN backend) or resets it to float32: either passes.

    What it kept is listed with the run's ISAs at the end (conftest), and is what snapshots and chunks hold.
    """
    saved = linear_bf16["save"]
    kept = _kept_dtype(saved)
    reset = "" if kept == SSM_DTYPE else " (vLLM reset it on this CPU: the bf16 state is not tested here)"
    ISAS_SEEN[f"linear-attention SSM state, mamba_ssm_cache_dtype={SSM_DTYPE}"] = f"{kept}{reset}"
    assert kept in (SSM_DTYPE, "float32"), kept
    assert saved["engine_states"]["conv_layout"] == "SD"
    assert saved["hybrid_manager_off"] is False and saved["mamba_cache_mode"] == "align"
    for name in ("prefill", "snap"):
        states = linear_bf16[name].states
        assert states is not None
        assert [str(t.dtype) for t in states.tensors[0]] == ["torch.bfloat16", f"torch.{kept}"], f"{name}, kept {kept}"
    store, prompts, chunk = linear_bf16["store"], saved["prompts"], saved["chunk_tokens"]
    path = _chunk_path(store, prompts["d"] + saved["outputs"]["d"], chunk, 1)  # taken by the 8th decode step
    states = hv.load(path).states
    assert states is not None and states.positions == (2 * chunk,)
    recurrent = states.tensors[0][1]
    assert str(recurrent.dtype) == f"torch.{kept}" and states.nbytes == state_bytes(recurrent.element_size())
    assert hv.validate(path).ok


def test_bf16_ssm_snapshot_states_equal_transformers(linear_bf16: dict[str, Any]) -> None:
    _assert_states_match(linear_bf16, _hf_model(linear_bf16["tmp"] / "model"), "bf16 SSM")


def test_bf16_ssm_chunks_resume_a_moved_request_as_the_unmoved_run(linear_bf16: dict[str, Any]) -> None:
    """Moved after 9 tokens to the same engine, its prefix cache emptied, "d" loads both chunks and goes on."""
    saved = linear_bf16["save"]
    b = saved["chunk_tokens"]
    assert saved["cached"]["d_moved"] == 2 * b  # both chunks from the store: chunk 1 with the 8th decode step's state
    assert saved["scheduler_stats"]["chunks_refused"] == 0
    rest = saved["outputs"]["d"][MOVED_AFTER:]
    got = saved["outputs"]["d_moved"][: len(rest)]
    what = f"bf16 SSM ({_kept_dtype(saved)} kept) d moved after {MOVED_AFTER} tokens"
    assert_continues(got, rest, linear_bf16["tmp"] / "model", saved["prompts"]["d_moved"], what)


def test_ds_conv_engine_loads_sd_chunks_with_identical_tokens(
    linear: dict[str, Any], linear_ds: dict[str, Any]
) -> None:
    """The format's conv state is one layout: an engine keeping it as ``[conv_dim, kernel - 1]`` loads SD chunks."""
    saved, ds = linear["save"], linear_ds["run"]
    assert ds["engine_states"]["conv_layout"] == "DS"
    assert saved["engine_states"]["conv_layout"] == "SD"  # the default on CPUs with avx512_bf16, and vLLM's
    for name, layers in (("DS", ds["engine_states"]["layers"]), ("SD", saved["engine_states"]["layers"])):
        conv = {tuple(c[0]) for c, _ in layers.values()}
        assert conv == ({(1024, 3)} if name == "DS" else {(3, 1024)}), f"{name}: {conv}"
    assert ds["mamba_ssm_cache_dtype"] == saved["mamba_ssm_cache_dtype"]  # else no chunk would load
    b = saved["chunk_tokens"]
    assert ds["block_size"] == b
    assert {rid: ds["outputs"][rid] for rid in saved["outputs"]} == saved["outputs"]
    assert ds["cached"]["a"] == 2 * b and ds["cached"]["d"] == b and ds["cached"]["e"] == b
    assert ds["scheduler_stats"]["chunks_refused"] == 0 and ds["worker_stats"]["tokens_loaded"] >= 3 * b
    # "d" moved after 9 tokens resumes at the state the 8th decode step of the SD engine took.
    assert ds["cached"]["d_moved"] == 2 * b
    rest = saved["outputs"]["d"][MOVED_AFTER:]
    got = ds["outputs"]["d_moved"][: len(rest)]
    assert_continues(got, rest, linear["tmp"] / "model", ds["prompts"]["d_moved"], "DS conv d moved from SD")


def test_ds_conv_snapshot_states_equal_transformers(linear_ds: dict[str, Any], hf_qwen3_next: Any) -> None:
    """States the DS engine loaded from SD chunks and computed on, and one it computed alone ("c")."""
    _assert_states_match(linear_ds, hf_qwen3_next, "DS conv")
