"""Hypothesis strategies: random but valid block-paged tensors and snapshots."""

from __future__ import annotations

import torch
from hypothesis import strategies as st

from hurray_vllm import BlockPagedTensor, KVSnapshot, LatentSplit, ModelFingerprint, RecurrentStates, SnapshotSource

DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float8_e4m3fn, torch.float8_e5m2, torch.int8]


@st.composite
def batches(
    draw: st.DrawFn, max_seqs: int = 5, max_pages: int = 12
) -> tuple[int, list[int], list[int], list[int], int]:
    """(page_size, seq_lens, block_table, seq_ptr, num_pages) with random aliasing."""
    page_size = draw(st.sampled_from([1, 2, 4, 16, 32]))
    num_seqs = draw(st.integers(0, max_seqs))
    seq_lens = [draw(st.integers(0, page_size * 4)) for _ in range(num_seqs)]
    num_pages = draw(st.integers(1, max_pages))
    table: list[int] = []
    ptr = [0]
    prev: list[int] = []
    for n in seq_lens:
        pages = -(-n // page_size)
        # Reuse a prefix of the previous sequence's pages (shared prefix), then fresh ids.
        share = draw(st.integers(0, min(pages, len(prev)))) if prev else 0
        own = prev[:share] + [draw(st.integers(0, num_pages - 1)) for _ in range(pages - share)]
        table.extend(own)
        ptr.append(len(table))
        prev = own
    return page_size, seq_lens, table, ptr, num_pages


def _pool(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=gen) * 4).to(dtype)
    return torch.randint(-100, 100, shape, generator=gen).to(dtype)


@st.composite
def paged_tensors(
    draw: st.DrawFn, dtype: torch.dtype | None = None, role: str = "key", layer: int | None = 0
) -> BlockPagedTensor:
    page_size, lens, table, ptr, num_pages = draw(batches())
    heads = draw(st.integers(1, 3))
    dim = draw(st.sampled_from([1, 4, 8]))
    dt = dtype or draw(st.sampled_from(DTYPES))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    pool = _pool((num_pages, page_size, heads, dim), dt, gen)
    return BlockPagedTensor(
        pool,
        torch.tensor(table, dtype=torch.int64),
        torch.tensor(ptr, dtype=torch.int64),
        torch.tensor(lens, dtype=torch.int64),
        role,
        layer,
        draw(st.sampled_from(["uint32", "uint64"])),
    )


@st.composite
def snapshots(draw: st.DrawFn, latent: bool | None = None, states: bool | None = None) -> KVSnapshot:
    """Random snapshots; ``latent``: True for MLA latents only, False for keys and values only.

    By default one in four holds MLA latents (one fused ``[.., 1, rank + rope]`` tensor per layer),
    and one in four key/value snapshots the recurrent states of linear-attention layers
    (``states``: True always, False never).
    """
    page_size, lens, table, ptr, num_pages = draw(batches())
    fused = draw(st.integers(0, 3)) == 0 if latent is None else latent
    split = LatentSplit(draw(st.sampled_from([4, 8])), 4, "deepseek_v2") if fused else None
    heads = 1 if split else draw(st.integers(1, 3))
    dim = split.head_dim if split else draw(st.sampled_from([4, 8]))
    dt = draw(st.sampled_from(DTYPES[:5]))
    layers = draw(st.integers(1, 3))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    bt, sp, sl = (torch.tensor(x, dtype=torch.int64) for x in (table, ptr, lens))
    roles = ("fused",) if split else ("key", "value")
    members = [
        tuple(
            BlockPagedTensor(_pool((num_pages, page_size, heads, dim), dt, gen), bt, sp, sl, role, i) for role in roles
        )
        for i in range(layers)
    ]
    extra = draw(st.integers(0, 1))
    token_ids = tuple(
        tuple(draw(st.lists(st.integers(0, 50000), min_size=n + extra, max_size=n + extra))) for n in lens
    )
    fp8 = dt in (torch.float8_e4m3fn, torch.float8_e5m2)
    arch = "DeepseekV2ForCausalLM" if split else "LlamaForCausalLM"
    with_states = not split and (draw(st.integers(0, 3)) == 0 if states is None else states)
    recurrent = None
    if with_states:
        n_state = draw(st.integers(1, 2))
        sdt = draw(st.sampled_from([torch.bfloat16, torch.float32]))
        shapes = ((2, draw(st.sampled_from([4, 8]))), (1, 4, 4))
        recurrent = RecurrentStates(
            "gdn_attn",
            tuple(range(n_state)),
            ("conv", "ssm"),
            tuple(lens),
            tuple(tuple(torch.randn((len(lens), *sh), generator=gen).to(sdt) for sh in shapes) for _ in range(n_state)),
        )
    return KVSnapshot.from_layers(
        members,
        latent=split,
        token_ids=token_ids,
        fingerprint=ModelFingerprint(arch, layers, heads, dim, str(dt).removeprefix("torch.")),
        kv_scales=tuple((0.5 + i, (0.5 if split else 0.25) + i) for i in range(layers)) if fp8 else None,
        source=SnapshotSource("test", "interchange", page_size),
        request_ids=tuple(f"req-{i}" for i in range(len(lens))),
        states=recurrent,
    )


def same_states(a: RecurrentStates | None, b: RecurrentStates | None) -> bool:
    """Equal layout and bit-identical tensors (or both absent)."""
    if a is None or b is None:
        return a is b
    layout = ("kind", "layers", "names", "positions", "split", "part")
    if any(getattr(a, x) != getattr(b, x) for x in layout):
        return False
    return all(
        x.dtype == y.dtype and torch.equal(x, y)
        for la, lb in zip(a.tensors, b.tensors, strict=True)
        for x, y in zip(la, lb, strict=True)
    ) and len(a.tensors) == len(b.tensors)


def same_snapshot(a: KVSnapshot, b: KVSnapshot) -> bool:
    """Equal in everything a reader may rely on (pages are compared by their valid tokens)."""
    if a.num_layers != b.num_layers or a.token_ids != b.token_ids or a.fingerprint != b.fingerprint:
        return False
    if a.kv_scales != b.kv_scales or a.source != b.source or a.request_ids != b.request_ids:
        return False
    if a.latent != b.latent or a.roles != b.roles or not same_states(a.states, b.states):
        return False
    for x, y in zip(a.tensors(), b.tensors(), strict=True):
        if not same_tensor(x, y):
            return False
    return True


def same_tensor(x: BlockPagedTensor, y: BlockPagedTensor) -> bool:
    return (
        x.kv_role == y.kv_role
        and x.layer_index == y.layer_index
        and x.index_type == y.index_type
        and x.dtype == y.dtype
        and torch.equal(x.block_table, y.block_table)
        and torch.equal(x.seq_ptr, y.seq_ptr)
        and (x.seq_lens is None) == (y.seq_lens is None)
        and (x.seq_lens is None or torch.equal(x.seq_lens, y.seq_lens))  # type: ignore[arg-type]
        and torch.equal(x.page_pool.view(torch.uint8), y.page_pool.view(torch.uint8))
    )
