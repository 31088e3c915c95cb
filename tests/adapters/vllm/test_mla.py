"""MLA (DeepSeek-V2-style) latents from real vLLM engines, against transformers as ground truth.

One engine saves (HurrayConnector) and snapshots mid-decode; another, at
tensor parallelism 2 (the latent is replicated on every rank), loads the
chunks and snapshots at the same point; a third loads from a store with one
chunk damaged. The engines run on the backend vLLM's CPU platform picks
(``adapters.vllm.layouts.cpu_mla_backend``): ``AMX_MLA`` on CPUs with AMX (blocks of 32,
prefix caching on), else ``CPU_MLA`` (blocks of 16; the platform turns
prefix caching off for it, whatever the engine asks for).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import require
from engine_script import run_engine_script
from margins import agreement, assert_agrees, assert_continues, recompute_logits
from prefetch import prefetched
from servers import side_by_side
from tiny_models import build_tiny_deepseek_v2

import hurray_vllm as hv
from hurray_vllm.adapters import transformers as tfa

pytestmark = [pytest.mark.vllm]
HERE = Path(__file__).resolve().parents[2]


def _run(tmp: Path, name: str, store: Path, mode: str, tp: int = 1) -> dict[str, Any]:
    args = [str(tmp / "model"), str(tmp / name), str(store), mode, str(tp)]
    env = {"VLLM_CPU_OMP_THREADS_BIND": "|".join(str(i % (os.cpu_count() or 1)) for i in range(tp))} if tp > 1 else {}
    return run_engine_script("mla_engine_run.py", args, tmp / name, f"MLA engine {name} (TP = {tp})", env=env)


@pytest.fixture(scope="session")
@prefetched
def mla(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    require("transformers")
    require("vllm")
    tmp = tmp_path_factory.mktemp("mla")
    build_tiny_deepseek_v2(tmp / "model")
    store = tmp / "store"
    saved = _run(tmp, "save", store, "save")
    runs: dict[str, Any] = {"tmp": tmp, "save": saved, "file": saved["dir"] / "snap.hrry"}
    runs["snap"] = hv.load(runs["file"])
    broken, loaded = tmp / "broken-store", tmp / "tp2-store"
    shutil.copytree(store, broken)
    shutil.copytree(store, loaded)
    runs["damaged"] = _damage_second_chunk_of(broken, saved["prompts"]["a"], saved["chunk_tokens"])
    runs |= side_by_side(
        {
            # Loads every whole chunk on both ranks, and snapshots mid-decode as the first engine did.
            "load": lambda: _run(tmp, "load", loaded, "save", tp=2),
            "broken": lambda: _run(tmp, "broken", broken, "load"),
        }
    )
    runs["snap2"] = hv.load(runs["load"]["dir"] / "snap.hrry")
    return runs


def _damage_second_chunk_of(store: Path, prompt: list[int], chunk: int) -> Path:
    from hurray_vllm.chunks import chunk_keys

    (ns,) = [p.name for p in store.iterdir()]
    path = store / ns / f"{chunk_keys(prompt, chunk, ns)[1]}.hrry"
    raw = bytearray(path.read_bytes())
    raw[8192 + 100] ^= 0x40  # inside the first latent pool: only the digest notices
    path.write_bytes(bytes(raw))
    return path


@pytest.fixture(scope="module")
def hf_mla(mla: dict[str, Any]) -> Any:
    from transformers import DeepseekV2ForCausalLM

    return DeepseekV2ForCausalLM.from_pretrained(mla["tmp"] / "model", dtype=torch.bfloat16).eval()


def test_snapshot_names_the_latent_split(mla: dict[str, Any]) -> None:
    snap = mla["snap"]
    assert snap.is_latent and snap.roles == ("fused",) and snap.request_ids == ("a", "b", "c")
    assert snap.latent == hv.LatentSplit(512, 64, "deepseek_v2")
    fp = snap.fingerprint
    assert fp is not None and (fp.architecture, fp.num_kv_heads, fp.head_dim) == ("DeepseekV2ForCausalLM", 1, 576)
    saved = mla["save"]
    block, reference = saved["block_size"], saved["backend"] == "CPU_MLA"
    assert (block, saved["prefix_caching"]) == ((16, False) if reference else (32, True))
    assert snap.source is not None and snap.source.layout == ("vllm-cpu-mla" if reference else "vllm-mla")
    assert snap.page_size == block and snap[0, "fused"].page_pool.shape[1:] == (block, 1, 576)
    t = snap[0, "fused"]
    assert torch.equal(t.to_dense(1)[:64], t.to_dense(0)[:64])
    if not saved["prefix_caching"]:
        # "b" holds its own copy of the 64 tokens it shares with "a", and the export keeps them apart
        # (it invents no sharing).
        assert not set(t.pages_of(1).tolist()) & set(t.pages_of(0).tolist())


def _close(got: torch.Tensor, ref: torch.Tensor) -> bool:
    """Within bf16 of transformers' latent, after the layers before it rounded differently.

    The kv_a_layernorm output of layer 1 differs by up to ~0.05 from
    transformers' (its input carries layer 0's bf16 roundings, which the norm
    scales up): hence the absolute term. Wrong KV (a token's neighbour, a
    rotation at another position) is off by more than 1.
    """
    return bool(((got - ref).abs() <= 6e-2 + 2e-2 * ref.abs()).all())


def test_latent_equals_transformers_compressed_kv_and_rotated_k_pe(mla: dict[str, Any], hf_mla: Any) -> None:
    """vLLM's latent is transformers' kv_a_layernorm output, then its rotated k_pe (within bf16)."""
    snap = mla["snap"]
    for s, rid in enumerate(snap.request_ids):
        n = snap.seq_lens[s]
        assert n == len(mla["save"]["prompts"][rid]) + 1  # mid-decode: the prompt and the first sampled token
        with torch.no_grad():
            pkv = hf_mla(torch.tensor([list(snap.token_ids[s][:n])]), use_cache=True).past_key_values
        for layer, cached in enumerate(pkv.layers):
            ref = torch.cat([cached.keys[0, 0], cached.values[0, 0]], dim=-1).float()  # [n, 576]
            got = snap[layer, "fused"].to_dense(s)[:, 0].float()
            assert _close(got, ref), f"seq {rid} layer {layer}: max {(got - ref).abs().max()}"
            # The tolerance still refuses wrong KV: each token's latent against its neighbour's,
            assert not _close(got[1:], ref[:-1]), f"seq {rid} layer {layer}: a shifted latent passed"
            # and a k_pe rotated for the next position (vllm_patches' bug, in small).
            assert not _close(got[:-1, 512:], ref[1:, 512:]), f"seq {rid} layer {layer}: a misrotated k_pe passed"


def test_transformers_continues_the_vllm_snapshot(mla: dict[str, Any], hf_mla: Any) -> None:
    """transformers resumed from vLLM's latent goes on as vLLM did (margin rule: two arithmetics)."""
    snap, saved = mla["snap"], mla["save"]
    for s, rid in enumerate(snap.request_ids):
        prompt, tokens = saved["prompts"][rid], saved["outputs"][rid]
        # Mid-decode: prompt + 2 sampled tokens, the last of which has no KV yet.
        assert list(snap.token_ids[s]) == prompt + tokens[:2]
        logits = tfa.teacher_forced_logits(hf_mla, snap, s, tokens[2:])
        assert_agrees(logits, tokens[2:], f"MLA {rid}: transformers from vLLM's latent")
        # transformers recomputing everything agrees too: the two engines compute the same model.
        assert_agrees(recompute_logits(hf_mla, prompt, tokens), tokens, f"MLA {rid}: transformers' own recompute")
    assert len(set(saved["outputs"]["a"])) > 3  # the tiny model's tokens vary: the comparison means something


def test_the_margin_rule_refuses_a_shifted_latent(mla: dict[str, Any], hf_mla: Any) -> None:
    """The companion of the relaxed comparison above: pages one off, and the continuation is refused."""
    from dataclasses import replace

    snap, saved = mla["snap"], mla["save"]
    wrong = replace(snap, fused=tuple(replace(x, block_table=(x.block_table + 1) % x.num_pages) for x in snap.fused))
    tokens = saved["outputs"]["a"]
    assert not agreement(tfa.teacher_forced_logits(hf_mla, wrong, 0, tokens[2:]), tokens[2:]).ok


def test_another_engine_at_tp2_loads_the_latent_chunks(mla: dict[str, Any]) -> None:
    saved, load = mla["save"], mla["load"]
    assert saved["worker_stats"]["chunks_saved"] == 3  # "a"'s three chunks; "b" shares two of them
    for rid, tokens in saved["outputs"].items():  # equal, but for AMX_MLA's rounding at TP = 2 (near-ties)
        assert_continues(load["outputs"][rid], tokens, mla["tmp"] / "model", saved["prompts"][rid], f"TP = 2 {rid}")
    # Every whole chunk before the last prompt token comes from the store, counted by vLLM.
    assert load["cached"] == {"a": 96, "b": 64, "c": 0}
    # The latent is replicated: each rank writes every chunk whole; only rank 0 would save one. With prefix
    # caching (AMX_MLA) "b" may find the two chunks it shares with "a" in vLLM's own prefix cache instead.
    loads = [r["chunks_loaded"] for r in load["rank_stats"]]
    assert loads in (([5, 5], [3, 3]) if saved["prefix_caching"] else ([5, 5],)), loads
    assert load["rank_stats"][1]["chunks_saved"] == 0


def test_a_tp2_snapshot_equals_the_tp1_snapshot(mla: dict[str, Any]) -> None:
    """One latent per layer, exported once: the loaded tokens bit for bit, the computed ones within bf16."""
    one, two = mla["snap"], mla["snap2"]
    assert two.is_latent and two.heads is None and two.fingerprint == one.fingerprint
    assert two.seq_lens == one.seq_lens
    # The same tokens, but where AMX_MLA's rounding at TP = 2 took the other side of a near-tie
    # (test_another_engine_at_tp2_loads_the_latent_chunks): up to there, then.
    same = [
        next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a)) for a, b in zip(one.token_ids, two.token_ids)
    ]
    assert mla["save"]["backend"] == "AMX_MLA" or two.token_ids == one.token_ids
    loaded = mla["load"]["cached"]
    for layer in range(one.num_layers):
        for s, rid in enumerate(one.request_ids):
            a, b = (
                one[layer, "fused"].to_dense(s)[: same[s]].float(),
                two[layer, "fused"].to_dense(s)[: same[s]].float(),
            )
            n = loaded[rid]
            assert torch.equal(a[:n], b[:n]), f"layer {layer} {rid}: loaded latent differs"
            assert _close(b, a), f"layer {layer} {rid}: max {(b - a).abs().max()}"
            assert not _close(b[1:], a[:-1]), f"layer {layer} {rid}: a shifted latent passed"


def test_a_damaged_latent_chunk_is_refused_and_recomputed(mla: dict[str, Any], hf_mla: Any) -> None:
    """The damaged chunk is refused and quarantined; what it held is recomputed, correctly.

    The recomputation starts at token 32 where the unmoved run started at 0:
    other arithmetic, so its tokens meet the margin rule against transformers
    (a near-tie of this tiny model may go either way) rather than equal the
    first run's.
    """
    broken, saved = mla["broken"], mla["save"]
    # The chunk before the damaged one still loads. With prefix caching (AMX_MLA) "b" may also find the
    # chunk "a" recomputed, in vLLM's prefix cache or written again to the store.
    assert broken["cached"]["a"] == 32 and broken["cached"]["c"] == 0
    assert broken["cached"]["b"] in ((32, 64) if saved["prefix_caching"] else (32,)), broken["cached"]
    stats = broken["scheduler_stats"]
    assert stats["chunks_refused"] == 1 and stats["chunks_quarantined"] == 1
    # Moved aside, and written again from the recomputed latent: the store heals.
    damaged = mla["damaged"]
    assert damaged.with_name(damaged.name + ".bad").exists()
    from hurray_vllm.chunks.digest import digest_matches

    assert digest_matches(hv.load(damaged))
    for rid, tokens in broken["outputs"].items():
        prompt = saved["prompts"][rid]
        assert_agrees(recompute_logits(hf_mla, prompt, tokens), tokens, f"MLA {rid}: recomputed after a refused chunk")


def test_files_validate_and_pyhurray_reads_them(mla: dict[str, Any], hurray: Any) -> None:
    path = mla["file"]
    assert hv.validate(path).ok
    ref = hurray.load(str(path))
    layer = ref["layers.0"]
    assert layer.members[0].layout.kv_role == "fused"
    assert list(layer.members[0].shape)[-2:] == [1, 576]
