"""Snapshots of real vLLM engines at tensor parallelism 2 (CPU, one core per rank) against TP = 1.

Each rank holds half of the tiny Llama's two KV heads; ``snapshot()`` joins
them. The same requests at TP = 1 are the reference: layer 0's K/V come from
the same dot products on both (bit for bit), later layers' inputs went
through an all-reduce that sums in another order (within bf16). The engines
are ``test_tp_connector.py``'s two savers (``tests/tp_engines.py``): each
snapshots the same requests after the same steps, once its own chunks are
saved (its connector then loads nothing: vLLM's prefix cache holds them).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import hurray_vllm as hv

pytestmark = [pytest.mark.vllm]


def _runs(run: dict[str, Any]) -> dict[str, Any]:
    """A saver of ``tp_engines``, with what it snapshotted (``tp_connector_run.snapshot_prompts``)."""
    out = run["dir"]
    return {
        **run,
        "snap": hv.load(out / "snap.hrry"),
        "stream": hv.load(out / "snap.hrrs"),
        "ranks": [out / name for name in run["rank_files"]],
    }


@pytest.fixture(scope="session")
def tp_runs(tp_engines: dict[str, Any]) -> dict[int, dict[str, Any]]:
    """The TP = 1 and TP = 2 savers of ``tp_engines`` (``tests/tp_engines.py``): the same requests, the same steps."""
    return {1: _runs(tp_engines["save1"]), 2: _runs(tp_engines["save2"])}


def test_tp2_greedy_tokens_equal_tp1(tp_runs: dict[int, dict[str, Any]]) -> None:
    assert tp_runs[2]["outputs"] == tp_runs[1]["outputs"]


def test_a_tp2_snapshot_holds_every_head_and_equals_tp1(tp_runs: dict[int, dict[str, Any]]) -> None:
    one, two = tp_runs[1]["snap"], tp_runs[2]["snap"]
    assert two.fingerprint == one.fingerprint and two.fingerprint.num_kv_heads == 2  # type: ignore[union-attr]
    assert two.token_ids == one.token_ids and two.seq_lens == one.seq_lens
    for layer in range(one.num_layers):
        for role in one.roles:
            for s in range(one.num_seqs):
                a, b = one[layer, role].to_dense(s).float(), two[layer, role].to_dense(s).float()
                assert a.shape == b.shape and a.shape[1] == 2, f"layer {layer} {role} seq {s}"
                if layer == 0:  # the same dot products on both: bit for bit
                    assert torch.equal(a, b), f"layer 0 {role} seq {s}"
                else:  # after an all-reduce summed in another order
                    assert ((a - b).abs() <= 2e-2 + 2e-2 * a.abs()).all(), f"layer {layer} {role} seq {s}"
                    # The tolerance still refuses the other head's KV.
                    assert not ((a.flip(1) - b).abs() <= 2e-2 + 2e-2 * a.abs()).all()


def test_the_tp2_stream_equals_the_tp2_snapshot(tp_runs: dict[int, dict[str, Any]]) -> None:
    snap, stream = tp_runs[2]["snap"], tp_runs[2]["stream"]
    for x, y in zip(snap.tensors(), stream.tensors(), strict=True):
        assert torch.equal(x.page_pool.view(torch.uint8), y.page_pool.view(torch.uint8))


def test_each_rank_streams_its_own_heads_and_they_join_into_the_snapshot(
    tp_runs: dict[int, dict[str, Any]], hurray: Any
) -> None:
    """``snapshot_ranks``: every rank writes its heads from its own process, marked with them; pyhurray reads each."""
    from hurray_vllm.kv.heads import concat_heads
    from hurray_vllm.kv.snapshot import HeadRange

    one = tp_runs[1]["ranks"]
    assert [p.name for p in one] == ["rank0.hrrs"]
    whole = hv.load(one[0])
    assert whole.heads is None
    for x, y in zip(tp_runs[1]["snap"].tensors(), whole.tensors(), strict=True):
        assert torch.equal(x.page_pool.view(torch.uint8), y.page_pool.view(torch.uint8))
    two = tp_runs[2]["ranks"]
    assert [p.name for p in two] == ["rank0.heads0-1.hrrs", "rank1.heads1-2.hrrs"]
    slices = [hv.load(p) for p in two]
    assert [s.heads for s in slices] == [HeadRange(0, 1, 2), HeadRange(1, 2, 2)]
    assert all(s.roles == ("key", "value") and s[0, "key"].num_heads == 1 for s in slices)
    joined, snap = concat_heads(slices), tp_runs[2]["snap"]
    assert joined.heads is None and joined.token_ids == snap.token_ids and joined.fingerprint == snap.fingerprint
    for x, y in zip(snap.tensors(), joined.tensors(), strict=True):
        assert torch.equal(x.page_pool.view(torch.uint8), y.page_pool.view(torch.uint8))
    for p, s in zip(two, slices, strict=True):
        assert hv.validate(p).ok
        ref = list(hurray.StreamReader(str(p)))  # the reference reads a slice as any snapshot
        assert len(ref) == 1 + s.num_layers
        assert list(ref[1].members[0].shape)[-2:] == [1, s[0, "key"].head_dim]
