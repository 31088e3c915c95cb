"""The PyTorch reference attention against PyTorch's own attention kernels.

``hurray_vllm.adapters.reference.paged_attention`` stands in for flash-attn on the
CPU, so its semantics (GQA head mapping, bottom-right causal alignment for
queries over a longer cache, the page walk) are checked here against
``scaled_dot_product_attention`` over each sequence's dense K/V: the math
backend on the CPU, and on CUDA the FlashAttention-2 kernel PyTorch ships,
which also runs the reference on the device.
"""

from __future__ import annotations

import pytest
import torch
from synthetic import make_snapshot
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right
from torch.nn.functional import scaled_dot_product_attention

from hurray_vllm import BlockPagedTensor, HurrayArgumentError
from hurray_vllm.adapters.flash_attn import to_flash_attn
from hurray_vllm.adapters.reference import paged_attention

#: A shared prefix, a shared partial tail, lengths off the page size.
LENS = [300, 300, 513, 37]
SHARES = [0, 100, 1, 0]
HEADS_K, GROUP, DIM = 2, 3, 64


def _check(device: str, backend: SDPBackend, seqlen_q: int, dtype: torch.dtype, tol: float) -> None:
    """``dtype`` is the cache's; the math backend gets float32 copies (the reference accumulates in float32)."""
    exact = backend == SDPBackend.MATH
    snap = make_snapshot(LENS, SHARES, 16, heads=HEADS_K, dim=DIM, dtype=dtype, layers=1)
    cache = to_flash_attn(snap, 0, page_size=256, device=device)
    gen = torch.Generator().manual_seed(3)
    q = torch.randn((len(LENS), seqlen_q, HEADS_K * GROUP, DIM), generator=gen).to(dtype).to(device)
    got = paged_attention(q, cache.k_cache, cache.v_cache, cache.cache_seqlens, cache.block_table)
    assert got.device.type == device
    for b, n in enumerate(LENS):
        # Query head h reads KV head h // GROUP (flash-attn's GQA mapping).
        k = snap.keys[0].to_dense(b).to(device).repeat_interleave(GROUP, dim=1)
        v = snap.values[0].to_dense(b).to(device).repeat_interleave(GROUP, dim=1)
        qb = q[b].transpose(0, 1).unsqueeze(0)  # [1, H, seqlen_q, D]
        if exact:
            qb, k, v = qb.float(), k.float(), v.float()
        mask = causal_lower_right(seqlen_q, n) if seqlen_q > 1 else None
        with sdpa_kernel(backend):
            want = scaled_dot_product_attention(
                qb, k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0), attn_mask=mask
            )
        want = want[0].transpose(0, 1)  # [seqlen_q, H, D]
        err = (got[b].float() - want.float()).abs().max().item()
        scale = max(want.float().abs().max().item(), 1.0)
        assert err <= tol * scale, f"sequence {b}: max |reference - sdpa| = {err} (output scale {scale})"


@pytest.mark.parametrize("seqlen_q", [1, 5])
def test_reference_matches_sdpa_on_cpu(seqlen_q: int) -> None:
    _check("cpu", SDPBackend.MATH, seqlen_q, torch.bfloat16, 2e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("seqlen_q", [1, 5])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_reference_on_cuda_matches_flash_sdpa(seqlen_q: int, dtype: torch.dtype) -> None:
    _check("cuda", SDPBackend.FLASH_ATTENTION, seqlen_q, dtype, 2e-2 if dtype == torch.bfloat16 else 4e-3)


def _dense_masked(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool, window: tuple[int, int], softcap: float
) -> torch.Tensor:
    """One sequence, written out as flash-attn documents it: q ``[Sq, H, D]``, k/v ``[Sk, H, D]`` (GQA expanded)."""
    sq, sk = q.shape[0], k.shape[0]
    scores = torch.einsum("qhd,khd->hqk", q.float(), k.float()) / q.shape[-1] ** 0.5
    if softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)
    left, right = window[0], 0 if causal else window[1]
    out = torch.zeros(sq, q.shape[1], v.shape[-1])
    for i in range(sq):
        at = i + sk - sq  # the key aligned with query i (bottom right)
        keys = [j for j in range(sk) if (left < 0 or j >= at - left) and (right < 0 or j <= at + right)]
        if keys:  # a query that sees no key gives zeros
            probs = scores[:, i, keys].softmax(-1)  # [H, len(keys)]
            out[i] = torch.einsum("hk,khd->hd", probs, v[keys].float())
    return out


@pytest.mark.parametrize("seqlen_q", [1, 5])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(("window", "softcap"), [((-1, -1), 4.0), ((40, -1), 0.0), ((3, 2), 0.0), ((0, 0), 2.0)])
def test_window_and_softcap_match_a_hand_masked_dense_attention(
    seqlen_q: int, causal: bool, window: tuple[int, int], softcap: float
) -> None:
    """flash_attn_with_kvcache forwards window_size and softcap: the reference computes them as flash-attn does."""
    lens = [300, 37, 4]
    snap = make_snapshot(lens, [0, 1, 0], 16, heads=HEADS_K, dim=DIM, dtype=torch.float32, layers=1)
    cache = to_flash_attn(snap, 0, page_size=16, flavor="vllm", dtype=torch.bfloat16)
    q = torch.randn((len(lens), seqlen_q, HEADS_K * GROUP, DIM), generator=torch.Generator().manual_seed(1))
    q = q.to(torch.bfloat16) * 4  # large scores, so that the cap changes them
    args = (q, cache.k_cache, cache.v_cache, cache.cache_seqlens, cache.block_table)
    got = paged_attention(*args, causal=causal, window_size=window, softcap=softcap)
    for b in range(len(lens)):
        k = cache_dense(snap.keys[0], b)
        v = cache_dense(snap.values[0], b)
        want = _dense_masked(q[b], k, v, causal=causal, window=window, softcap=softcap)
        torch.testing.assert_close(got[b].float(), want, rtol=2e-2, atol=2e-2)
    plain = paged_attention(*args, causal=causal)
    assert not torch.allclose(got.float(), plain.float(), atol=2e-2), "the options change the result"


def cache_dense(t: BlockPagedTensor, b: int) -> torch.Tensor:
    """Sequence ``b``'s keys or values as the bfloat16 cache holds them, GQA heads expanded."""
    return t.to_dense(b).to(torch.bfloat16).repeat_interleave(GROUP, dim=1)


def test_reference_refuses_options_out_of_range() -> None:
    snap = make_snapshot([20], [0], 16, heads=HEADS_K, dim=DIM, layers=1)
    cache = to_flash_attn(snap, 0, page_size=16, flavor="vllm")
    q = torch.zeros(1, 1, HEADS_K, DIM, dtype=torch.bfloat16)
    args = (q, cache.k_cache, cache.v_cache, cache.cache_seqlens, cache.block_table)
    for kwargs, field in (
        ({"window_size": (-2, 0)}, "window_size"),
        ({"window_size": (1,)}, "window_size"),
        ({"softcap": -1.0}, "softcap"),
        ({"softcap": float("nan")}, "softcap"),
    ):
        with pytest.raises(HurrayArgumentError) as err:
            paged_attention(*args, **kwargs)  # type: ignore[arg-type]
        assert err.value.field == field, kwargs


def test_a_refused_call_leaves_the_cache_unwritten() -> None:
    """Appended tokens are written in place: every check runs first, or a failed call would change the cache."""
    k_cache, v_cache = torch.zeros(2, 4, 1, 8), torch.zeros(2, 4, 1, 8)
    new = torch.ones(1, 1, 1, 8)

    def append(table: list[list[int]], v: torch.Tensor) -> str:
        with pytest.raises(HurrayArgumentError) as err:
            paged_attention(
                torch.randn(1, 1, 1, 8), k_cache, v_cache, torch.tensor([4]), torch.tensor(table), k=new, v=v
            )
        return err.value.field

    # Token 4 goes to page 1 (valid), but page -1 (the sequence's first) is not a page of the cache.
    assert append([[-1, 1]], new) == "block_table"
    assert append([[0, 1]], new[..., :4]) == "v"
    assert not k_cache.any() and not v_cache.any()


def test_new_tokens_that_are_views_of_a_cache_are_refused_before_any_write() -> None:
    """k viewing k_cache: torch refused the write (RuntimeError); v viewing v_cache: after k_cache was written."""
    from hurray_vllm.adapters.reference import append_kv_

    def caches() -> tuple[torch.Tensor, torch.Tensor]:
        return torch.arange(16.0).reshape(2, 4, 1, 2), torch.arange(16.0).reshape(2, 4, 1, 2) + 100

    q, lens, table = torch.randn(1, 1, 1, 2), torch.tensor([1]), torch.tensor([[0, 1]])
    fresh = torch.ones(1, 2, 1, 2)
    for field, pick in (
        ("k", lambda kc, vc: (kc[0:1, 0:2], fresh)),
        ("v", lambda kc, vc: (fresh, vc[0:1, 0:2])),
        ("v", lambda kc, vc: (fresh, kc[1:2, 2:4])),  # v read after k_cache is written: changed under it
        ("k", lambda kc, vc: (vc[0:1, 0:2], fresh)),
    ):
        for call in (
            lambda kc, vc, k, v: paged_attention(q, kc, vc, lens, table, k=k, v=v),
            lambda kc, vc, k, v: append_kv_(kc, vc, table, lens, k, v),
        ):
            kc, vc = caches()
            with pytest.raises(HurrayArgumentError) as err:
                call(kc, vc, *pick(kc, vc))
            assert err.value.field == field
            assert torch.equal((kc, vc)[0], caches()[0]) and torch.equal(vc, caches()[1])


@pytest.mark.parametrize("name", ["q_descale", "k_descale", "v_descale"])
@pytest.mark.parametrize("shape", [(2,), (2, 1), (1, 2), (3, 2), (2, 2, 1)], ids=str)
def test_descales_must_be_batch_by_kv_heads(name: str, shape: tuple[int, ...]) -> None:
    """Broadcastable shapes ([batch, 1], [1, nheads_k]) scaled silently; others failed inside the arithmetic."""
    kc = torch.randn(4, 4, 2, 8)
    q, lens, table = torch.randn(2, 1, 4, 8), torch.tensor([5, 3]), torch.tensor([[0, 1], [2, 3]])
    with pytest.raises(HurrayArgumentError) as err:
        paged_attention(q, kc, kc, lens, table, **{name: torch.ones(shape)})
    assert err.value.field == name
    assert paged_attention(q, kc, kc, lens, table, **{name: torch.ones(2, 2)}).shape == q.shape


def test_append_kv_checks_its_arguments_like_paged_attention() -> None:
    """A table of the wrong shape, short lengths or negative lengths failed deep in torch (or wrote wrapped slots)."""
    from hurray_vllm.adapters.reference import append_kv_

    for field, table, lens in (
        ("block_table", [[0, 1]], [1, 2]),
        ("block_table", [0, 1], [1, 2]),
        ("cache_seqlens", [[0, 1], [2, 3]], [1]),
        ("cache_seqlens", [[0, 1], [2, 3]], [-1, 2]),
        ("cache_seqlens", [[0, 1], [2, 3]], [-5, 2]),
        ("cache_seqlens", [[0, 1], [2, 3]], [8, 2]),
        ("block_table", [[0, 9], [2, 3]], [4, 2]),
    ):
        kc, vc = torch.zeros(4, 4, 1, 2), torch.zeros(4, 4, 1, 2)
        new = torch.ones(2, 1, 1, 2)
        with pytest.raises(HurrayArgumentError) as err:
            append_kv_(kc, vc, torch.tensor(table), torch.tensor(lens), new, new)
        assert err.value.field == field, (table, lens)
        assert not kc.any() and not vc.any()
