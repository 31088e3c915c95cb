"""A sliding-window hybrid (Gemma 3 style) exported from a real vLLM engine, against transformers.

vLLM runs its hybrid KV cache manager: one KV cache group per layer here
(3 sliding-window groups, 1 full), and it frees the sliding groups' blocks
that fall out of the window. The snapshot holds only the pages still inside.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import require
from engine_script import run_engine_script
from margins import agreement, assert_agrees
from prefetch import prefetched
from tiny_models import build_tiny_gemma3

import hurray_vllm as hv
from hurray_vllm.adapters import transformers as tfa

pytestmark = [pytest.mark.vllm]
HERE = Path(__file__).resolve().parents[2]
WINDOW = 64


@pytest.fixture(scope="session")
@prefetched
def hybrid(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    require("transformers")
    require("vllm")
    tmp = tmp_path_factory.mktemp("hybrid")
    build_tiny_gemma3(tmp / "model", window=WINDOW)
    out = tmp / "run"
    result = run_engine_script("window_engine_run.py", [str(tmp / "model"), str(out)], out, "hybrid engine")
    return {"tmp": tmp, "dir": out, "result": result, "snap": hv.load(out / "snap.hrry")}


@pytest.fixture(scope="module")
def hf_gemma(hybrid: dict[str, Any]) -> Any:
    from transformers import Gemma3ForCausalLM

    return Gemma3ForCausalLM.from_pretrained(hybrid["tmp"] / "model", dtype=torch.bfloat16).eval()


def test_the_engine_keeps_its_hybrid_manager_and_frees_old_window_blocks(hybrid: dict[str, Any]) -> None:
    result = hybrid["result"]
    assert result["hybrid_manager_off"] is False
    (a,) = [groups for rid, groups in result["block_ids"].items() if rid.startswith("a")]
    assert a[0][:4] == [0, 0, 0, 0] and 0 not in a[3]  # a sliding group's freed blocks, the full group's all held


def test_snapshot_holds_only_the_window_of_sliding_layers(hybrid: dict[str, Any]) -> None:
    snap = hybrid["snap"]
    win = snap.windows
    assert win is not None and win.sizes == (WINDOW, WINDOW, WINDOW, None)
    n = snap.seq_lens
    for s in range(snap.num_seqs):
        for layer, size in enumerate(win.sizes):
            start = win.kv_start[layer][s]
            if size is None:
                assert start == 0
            else:  # vLLM frees whole blocks out of the next token's window, and no more
                assert start % 32 == 0 and start <= max(0, n[s] - size + 1) < start + 32 + size
    assert win.kv_start[0][0] == 128  # "a": 202 tokens, blocks 0-3 freed
    # Stored pages reflect the model: the sliding layers hold the window (plus one zero page).
    assert snap[0, "key"].num_pages < snap[3, "key"].num_pages
    assert snap.validate().ok and hv.validate(hybrid["dir"] / "snap.hrry").ok


def test_held_kv_equals_transformers_and_the_rest_is_zero(hybrid: dict[str, Any], hf_gemma: Any) -> None:
    snap = hybrid["snap"]
    for s in range(snap.num_seqs):
        n = snap.seq_lens[s]
        ids = list(snap.token_ids[s][:n])
        with torch.no_grad():
            # No config: a plain DynamicCache keeps every token of every layer, the ground truth to compare with.
            out = hf_gemma(torch.tensor([ids]), use_cache=True, past_key_values=_full_cache())
        for layer, cached in enumerate(out.past_key_values.layers):
            start = snap.windows.kv_start[layer][s]
            for role, ref in (("key", cached.keys), ("value", cached.values)):
                got = snap[layer, role].to_dense(s).float()  # [n, H, D]
                want = ref[0].transpose(0, 1).float()
                assert not got[:start].any(), f"seq {s} layer {layer} {role}: freed positions are not zero"
                assert _close(got[start:], want[start:]), f"seq {s} layer {layer} {role}"
                # The tolerance still refuses wrong KV: each token's against its neighbour's.
                assert not _close(got[start + 1 :], want[start:-1]), f"seq {s} layer {layer} {role}: shifted passed"


def _close(got: torch.Tensor, ref: torch.Tensor) -> bool:
    """Within bf16 of transformers, after earlier layers rounded differently.

    Gemma 3 normalizes keys (``k_norm``), which scales up the differences its
    input carries from the layers before: hence the absolute term (the largest
    difference seen is ~0.04). A neighbour's KV is off by more than 1.
    """
    return bool(((got - ref).abs() <= 6e-2 + 2e-2 * ref.abs()).all())


def _full_cache() -> Any:
    from transformers import DynamicCache

    return DynamicCache()


def test_transformers_continues_from_the_windows(hybrid: dict[str, Any], hf_gemma: Any) -> None:
    """Resumed from the held windows only, transformers goes on as vLLM did (margin rule: two arithmetics)."""
    snap, result = hybrid["snap"], hybrid["result"]
    for s, rid in enumerate(snap.request_ids):
        prompt, tokens = result["prompts"][rid], result["outputs"][rid]
        assert list(snap.token_ids[s]) == prompt + tokens[:3]  # after the prefill and two decode steps
        logits = tfa.teacher_forced_logits(hf_gemma, snap, s, tokens[3:])
        assert_agrees(logits, tokens[3:], f"hybrid {rid}: transformers from vLLM's windows")
    assert len(set(result["outputs"]["a"])) > 3  # the tiny model's tokens vary: the comparison means something


def test_the_margin_rule_refuses_windows_one_page_off(hybrid: dict[str, Any], hf_gemma: Any) -> None:
    """The companion of the relaxed comparison: every layer's pages shifted by one, and it is refused."""
    from dataclasses import replace

    snap, result = hybrid["snap"], hybrid["result"]

    def shift(t: hv.BlockPagedTensor) -> hv.BlockPagedTensor:
        return replace(t, block_table=(t.block_table + 1) % t.num_pages)

    wrong = replace(snap, keys=tuple(map(shift, snap.keys)), values=tuple(map(shift, snap.values)))
    tokens = result["outputs"]["a"]
    assert not agreement(tfa.teacher_forced_logits(hf_gemma, wrong, 0, tokens[3:]), tokens[3:]).ok


def test_resuming_before_the_window_is_refused(hybrid: dict[str, Any], hf_gemma: Any) -> None:
    snap = hybrid["snap"]
    with pytest.raises(hv.HurrayFormatError, match=r"snapshot\.windows"):
        tfa.to_dynamic_cache(snap, 0, model_config=hf_gemma.config, length=100)  # its window needs tokens from 37


def test_stream_export_and_pyhurray_agree(hybrid: dict[str, Any], hurray: Any) -> None:
    snap, out = hybrid["snap"], hybrid["dir"]
    streamed = hv.load(out / "snap.hrrs")
    assert streamed.windows == snap.windows
    for x, y in zip(streamed.tensors(), snap.tensors(), strict=True):
        assert torch.equal(x.page_pool.view(torch.uint8), y.page_pool.view(torch.uint8))
        assert torch.equal(x.block_table, y.block_table)
    ref = hurray.load(str(out / "snap.hrry"))
    assert [m.layout.kv_role for m in ref["layers.0"].members[:2]] == ["key", "value"]
