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


def _gdn_engine(ssm: torch.Tensor) -> tuple[object, object]:
    """A fake vLLM config and KV cache config: one gated-delta-net layer whose recurrent state memory is ``ssm``."""
    from types import SimpleNamespace

    class MambaSpec:  # the groups are told apart by the class name
        shapes = ((3, 8), tuple(ssm.shape[1:]))
        dtypes = (BF16, ssm.dtype)
        mamba_type = "gdn_attn"
        block_size = 32
        mamba_cache_mode = "none"

    name = "model.layers.0.linear_attn"
    conv = torch.zeros(ssm.shape[0], 3, 8, dtype=BF16)
    vllm_config = SimpleNamespace(
        parallel_config=SimpleNamespace(tensor_parallel_size=1),
        compilation_config=SimpleNamespace(static_forward_context={name: SimpleNamespace(kv_cache=[conv, ssm])}),
        cache_config=SimpleNamespace(block_size=32),
    )
    return vllm_config, SimpleNamespace(
        kv_cache_groups=[SimpleNamespace(kv_cache_spec=MambaSpec(), layer_names=[name])]
    )


def test_a_cpu_engines_recurrent_state_memory_is_read_in_the_formats_order_not_transposed() -> None:
    """Found by mutation testing: vLLM declares a gated delta net's recurrent state ``[v_heads, v_dim, k_dim]``;
    its GPU kernels address it so (a transpose to the format's ``[v_heads, k_dim, v_dim]``), its CPU kernels view
    the same memory as ``[v_heads, k_dim, v_dim]`` (a reshape). Transposed on the CPU, every state a CPU engine
    saved would be scrambled, and no test told."""
    from vllm.platforms import current_platform

    from hurray_vllm.adapters.vllm.states import state_cache

    v_heads, v_dim, k_dim = 2, 4, 6  # k_dim != v_dim: a transpose and a reshape differ
    mem = torch.arange(3 * v_heads * v_dim * k_dim, dtype=torch.float32).reshape(3, v_heads, v_dim, k_dim)
    cache = state_cache(*_gdn_engine(mem))
    assert cache is not None
    cpu = current_platform.is_cpu()
    assert cache.transforms == ("", "V" if cpu else "T")
    assert cache.spec.shapes[1] == (v_heads, k_dim, v_dim)
    states = cache.gather([{0: 2}], [32])
    want = mem[2].reshape(v_heads, k_dim, v_dim) if cpu else mem[2].transpose(-1, -2)
    assert torch.equal(states.tensors[0][1][0], want)
    again = torch.zeros_like(mem)  # and written back, the same memory again
    into = state_cache(*_gdn_engine(again))
    assert into is not None
    into.write([{0: [2]}], states)
    assert torch.equal(again[2], mem[2]) and not again[[0, 1]].any()
