"""What a saving rank makes of its replicas' state shares (``pack_states``, ``join_shares``), without an engine.

With fewer KV heads than ranks, the rank saving a KV head gathers the
linear-attention state shares of every rank (vLLM splits the state heads
over all of them) and stores its head's part: the buffers here are what
each rank sends.
"""

from __future__ import annotations

import pytest
import torch
from strategies import same_states

import hurray_vllm as hv
from hurray_vllm.adapters.vllm.states import join_shares, pack_states


def _whole() -> hv.RecurrentStates:
    """Odd sizes on purpose: at TP = 4 a bf16 conv share of 27 values (54 bytes) before an fp32 recurrent share."""
    gen = torch.Generator().manual_seed(0)
    conv = torch.randn(1, 3, 2 * 4 * 3 + 4 * 3, generator=gen).to(torch.bfloat16)  # q, k, v: 4 heads of 3 each
    layers = tuple((conv + j, torch.randn(1, 4, 3, 3, generator=gen)) for j in range(2))
    return hv.RecurrentStates("gdn_attn", (0, 1), ("conv", "ssm"), (9,), layers)


@pytest.mark.parametrize(
    ("tp", "heads"),
    [
        (2, None),  # one KV head on both ranks: the whole states
        (4, (0, 1, 2)),  # two KV heads at TP = 4: ranks 0 and 1 hold head 0
        (4, (1, 2, 2)),
        (2, (0, 1, 2)),  # as many KV heads as ranks: a rank's own share
    ],
)
def test_a_saving_rank_joins_every_share_and_keeps_its_heads_part(tp: int, heads: tuple[int, int, int] | None) -> None:
    whole = _whole()
    shares = [whole.take(r, r + 1, tp) for r in range(tp)]
    buffers = [pack_states(s) for s in shares]
    for mine in shares:  # any rank's share reads every buffer
        got = join_shares(mine, buffers, heads)
        assert same_states(got, whole if heads is None else whole.take(*heads))


def test_a_buffer_of_another_size_is_refused() -> None:
    whole = _whole()
    shares = [whole.take(r, r + 1, 2) for r in range(2)]
    buffers = [pack_states(shares[0]), pack_states(shares[1])[:-16]]
    with pytest.raises(hv.HurrayFormatError, match="rank 1 sent"):
        join_shares(shares[0], buffers, None)


def test_states_are_the_models_layers_in_order_however_vllm_groups_them() -> None:
    """vLLM deals layers round-robin into groups of one page size (``layers[i::num_groups]``): with two linear layers
    per group (Qwen3-Next's 3 linear + 1 full, twice) the groups list them 0, 4, 1, 5, 2, 6. A snapshot's states are
    the model's layers in order, which transformers pairs with the model's linear-attention layers."""
    from types import SimpleNamespace

    from hurray_vllm.adapters.vllm.states import declared_layout, state_groups

    class MambaSpec:  # what the groups are told apart by (the class name), and what declared_layout reads
        shapes = ((3, 8), (2, 4, 4))
        dtypes = (torch.bfloat16, torch.float32)
        mamba_type = "gdn_attn"

    class FullAttentionSpec:
        pass

    def group(spec: object, layers: tuple[int, ...], what: str) -> SimpleNamespace:
        return SimpleNamespace(kv_cache_spec=spec, layer_names=[f"model.layers.{i}.{what}" for i in layers])

    config = SimpleNamespace(
        kv_cache_groups=[
            group(FullAttentionSpec(), (3, 7), "self_attn.attn"),
            group(MambaSpec(), (0, 4), "linear_attn"),
            group(MambaSpec(), (1, 5), "linear_attn"),
            group(MambaSpec(), (2, 6), "linear_attn"),
        ]
    )
    of_layer = state_groups(config)
    assert list(of_layer) == [f"model.layers.{i}.linear_attn" for i in (0, 1, 2, 4, 5, 6)]
    assert [of_layer[f"model.layers.{i}.linear_attn"] for i in (0, 4, 1)] == [1, 1, 2]  # each keeps its group
    layout = declared_layout(config)
    assert layout is not None and layout.layers == (0, 1, 2, 4, 5, 6)


def test_the_declared_layout_at_tensor_parallelism_is_the_whole_models() -> None:
    """Found by mutation testing: at TP > 1 vLLM's ``MambaSpec`` shapes are one rank's share; the declared layout
    must multiply each split axis by ``tp`` (the conv channels, the value heads), so that chunks saved at any
    degree compare equal. Left a share, a TP = 2 engine's layout would not match chunks saved at TP = 1."""
    from types import SimpleNamespace

    from hurray_vllm.adapters.vllm.states import declared_layout
    from hurray_vllm.kv.states import state_split

    class MambaSpec:
        # One rank's share: conv [kernel - 1, 2 * key_dim + value_dim] with key_dim 6 and 2 value heads of 4
        # (value_dim 8), recurrent [v_heads, v_dim, k_dim] as vLLM declares it.
        shapes = ((3, 2 * 6 + 2 * 4), (2, 4, 3))
        dtypes = (torch.bfloat16, torch.float32)
        mamba_type = "gdn_attn"

    config = SimpleNamespace(
        kv_cache_groups=[SimpleNamespace(kv_cache_spec=MambaSpec(), layer_names=["model.layers.0.linear_attn"])]
    )
    one, two = declared_layout(config, tp=1), declared_layout(config, tp=2)
    assert one is not None and two is not None
    assert one.shapes == ((3, 20), (2, 3, 4))  # the format's [v_heads, k_dim, v_dim]
    assert two.shapes == ((3, 40), (4, 3, 4))  # conv channels and value heads doubled
    assert state_split(two.kind, two.layout, two.shapes) == ((1, (12, 12, 16)), (0, (4,)))
