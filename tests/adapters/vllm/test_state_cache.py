"""``StateCache.write`` checks every layer of the states it writes before writing any, without an engine.

It compared layer 0's shapes and dtypes with the cache's (``mismatches``):
a later layer of another shape failed in ``index_copy_`` with the layers
before it already written (a half-written state), and one of another dtype
was cast and written without a word.
"""

from __future__ import annotations

import pytest
import torch

import hurray_vllm as hv
from hurray_vllm.adapters.vllm.states import StateCache

BF16 = torch.bfloat16
SPEC = hv.RecurrentStates(
    "gdn_attn", (0, 1), ("conv", "ssm"), (), declared=(((3, 8), "bfloat16"), ((2, 4, 4), "bfloat16"))
)


def _cache() -> StateCache:
    """Two state layers in KV cache group 1, five blocks each, all zeros."""
    tensors = tuple((torch.zeros(5, 3, 8, dtype=BF16), torch.zeros(5, 2, 4, 4, dtype=BF16)) for _ in range(2))
    return StateCache(SPEC, ("model.layers.0.a", "model.layers.1.a"), (1, 1), tensors, ("", ""), 32, "none")


def _states(layer1: tuple[torch.Tensor, torch.Tensor]) -> hv.RecurrentStates:
    good = (torch.ones(1, 3, 8, dtype=BF16), torch.ones(1, 2, 4, 4, dtype=BF16))
    return hv.RecurrentStates("gdn_attn", (0, 1), ("conv", "ssm"), (32,), (good, layer1))


def test_good_states_are_written_into_their_block() -> None:
    cache = _cache()
    cache.write([{1: [3]}], _states((torch.ones(1, 3, 8, dtype=BF16), torch.ones(1, 2, 4, 4, dtype=BF16))))
    for layer in cache.tensors:
        for t in layer:
            assert bool((t[3] == 1).all()) and not t[[0, 1, 2, 4]].any()


@pytest.mark.parametrize(
    ("layer1", "field"),
    [
        ((torch.ones(1, 3, 8, dtype=BF16), torch.ones(1, 2, 4, 5, dtype=BF16)), "snapshot.states.ssm"),  # shape
        ((torch.ones(1, 3, 8, dtype=torch.float16), torch.ones(1, 2, 4, 4, dtype=BF16)), "snapshot.states.conv"),
    ],
    ids=["layer 1 of another shape", "layer 1 of another dtype"],
)
def test_a_later_layer_that_differs_is_refused_before_anything_is_written(
    layer1: tuple[torch.Tensor, torch.Tensor], field: str
) -> None:
    cache = _cache()
    with pytest.raises(hv.HurrayFormatError, match="state layer 1") as info:
        cache.write([{1: [3]}], _states(layer1))
    assert info.value.field == field
    assert not any(t.any() for layer in cache.tensors for t in layer)  # layer 0 untouched too


def test_a_load_refuses_such_states_when_it_plans_before_any_kv_block_is_written() -> None:
    """The worker plans a load's states before it writes the load's KV blocks (_plan_states): refused there, a bad
    later layer leaves the engine's KV untouched too, not only its states."""
    from types import SimpleNamespace

    from hurray_vllm.adapters.vllm.connector.worker import HurrayWorker

    cache = _cache()
    ec = SimpleNamespace(states=cache)
    task = SimpleNamespace(resume=32, state_blocks={1: [3]}, keys=["k"])
    good = SimpleNamespace(states=_states((torch.ones(1, 3, 8, dtype=BF16), torch.ones(1, 2, 4, 4, dtype=BF16))))
    assert HurrayWorker._plan_states(ec, task, [good]) is good.states  # type: ignore[arg-type]
    bad = SimpleNamespace(states=_states((torch.ones(1, 3, 8, dtype=BF16), torch.ones(1, 2, 4, 5, dtype=BF16))))
    with pytest.raises(hv.HurrayFormatError) as info:
        HurrayWorker._plan_states(ec, task, [bad])  # type: ignore[arg-type]
    assert info.value.field == "snapshot.states.ssm"
