"""Caches keyed by object identity cannot hand one object's result to another that reuses its id."""

from __future__ import annotations

import gc

import torch

from hurray_vllm.containers.stream import Same, layer_structure_key
from hurray_vllm.kv.paged import BlockPagedTensor
from hurray_vllm.wire import rules
from hurray_vllm.wire.descriptor import decode_descriptor, encode_descriptor


def _tensor(block_table: list[int]) -> BlockPagedTensor:
    n = len(block_table)
    return BlockPagedTensor(
        torch.zeros(n, 4, 1, 2), torch.tensor(block_table), torch.tensor([0, n]), torch.tensor([4 * n]), "key", 0
    )


def test_a_verdict_dies_with_its_descriptor() -> None:
    raw = encode_descriptor(_tensor([0, 1]).descriptor())
    d = rules.decode_checked(raw, "test")
    key = (id(d), False)
    assert key in rules._VERDICTS and rules.check_own(d) is rules._VERDICTS[key][1]
    rules._decode_and_check_memo.cache_clear()  # the LRU keeps decoded descriptors alive too
    del d
    gc.collect()
    assert key not in rules._VERDICTS
    # A descriptor that is not the remembered one is checked, not looked up.
    assert rules.check_own(decode_descriptor(raw)).ok


def test_the_index_cache_keeps_its_tensors_and_checks_identity() -> None:
    cache: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
    a = _tensor([0, 1])
    first = a.wire_buffers(cache)[1]
    assert torch.equal(first, torch.tensor([0, 1], dtype=torch.int32))
    # Forge an entry under another tensor's id: it is not used for that tensor.
    b = _tensor([1, 0])
    cache[(id(b.block_table), b.index_type)] = (a.block_table, first)
    assert torch.equal(b.wire_buffers(cache)[1], torch.tensor([1, 0], dtype=torch.int32))


def test_structure_keys_hold_their_tensors() -> None:
    a = _tensor([0, 1])
    key = layer_structure_key((a, a), None)
    assert key == layer_structure_key((a, a), None)
    assert key != layer_structure_key((_tensor([0, 1]), _tensor([0, 1])), None)  # equal values, other tensors
    assert key is not None and any(isinstance(x, Same) and x.obj is a.block_table for x in key)
    assert Same(a.block_table) != a.block_table
