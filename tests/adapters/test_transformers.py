"""The transformers adapter: vLLM snapshots continue in transformers, and transformers caches page into snapshots.

Ground truth is greedy decoding: a continuation from moved KV must produce the
very tokens an uninterrupted run produces (vLLM's own, or transformers').
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import require
from margins import agreement, assert_agrees, recompute_logits

import hurray_vllm as hv
from hurray_vllm.adapters import transformers as tfa

# The vLLM export tests' session fixtures: the tiny model, the engine runs, the bf16 HF model.

RIDS = ("a", "b", "c")
PROMPT = [(i * 37 + 11) % 500 + 1 for i in range(45)]


def greedy(model: Any, ids: list[int], n: int) -> list[int]:
    """transformers' own greedy continuation of ``ids`` (full recompute, no snapshot)."""
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
    return [int(t) for t in out[0, len(ids) :]]


def prefill(model: Any, ids: list[int]) -> tuple[Any, int]:
    """One forward over ``ids``: its cache and the greedy next token."""
    with torch.no_grad():
        out = model(torch.tensor([ids]), use_cache=True)
    return out.past_key_values, int(out.logits[0, -1].argmax())


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


@pytest.fixture(scope="module")
def hf_model_f32(tiny_model: Path) -> Any:
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()


# ── vLLM → transformers ────────────────────────────────────────────────────


@pytest.mark.vllm
@pytest.mark.parametrize("name", ["bf16-32", "bf16-64"])
def test_vllm_snapshot_continues_in_transformers(engine_runs, hf_model, name: str) -> None:  # type: ignore[no-untyped-def]
    """transformers resumed from vLLM's KV continues as vLLM does.

    vLLM's CPU kernels and transformers' ops round differently, so the
    comparison with vLLM's tokens is the margin rule (tests/margins.py);
    between two transformers paths it is exact.
    """
    out, result = engine_runs[name]
    snap = hv.load(out / "snap.hrry")
    isa = result["isa"]
    for s, rid in enumerate(RIDS):
        prompt, vllm_tokens = result["prompts"][rid], result["outputs"][rid]
        assert len(vllm_tokens) == 12
        # Mid-decode: prompt + 2 sampled tokens, the last of which has no KV yet.
        assert list(snap.token_ids[s]) == prompt + vllm_tokens[:2]
        assert snap.seq_lens[s] == len(prompt) + 1
        logits = tfa.teacher_forced_logits(hf_model, snap, s, vllm_tokens[2:])
        assert_agrees(logits, vllm_tokens[2:], f"{name} {rid}: transformers from vLLM's KV", isa=isa)
        # transformers recomputing everything agrees too: the two engines compute the same model.
        full = recompute_logits(hf_model, prompt, vllm_tokens)
        assert_agrees(full, vllm_tokens, f"{name} {rid}: transformers' own recompute", isa=isa)
        # Same arithmetic on both sides, so exact: generate() given the cache computes only the
        # pending token and goes on as continue_generation does.
        got = tfa.continue_generation(hf_model, snap, s, 10)
        cache = tfa.to_dynamic_cache(snap, s, model_config=hf_model.config)
        with torch.no_grad():
            gen = hf_model.generate(
                torch.tensor([snap.token_ids[s]]),
                past_key_values=cache,
                max_new_tokens=10,
                min_new_tokens=10,
                do_sample=False,
            )
        assert gen[0, len(snap.token_ids[s]) :].tolist() == got


def shifted_pages(snap: hv.KVSnapshot) -> hv.KVSnapshot:
    """Every block table entry one physical page further on (an off-by-one block id)."""
    return replace(
        snap,
        keys=tuple(replace(t, block_table=(t.block_table + 1) % t.num_pages) for t in snap.keys),
        values=tuple(replace(t, block_table=(t.block_table + 1) % t.num_pages) for t in snap.values),
    )


def swapped_kv(snap: hv.KVSnapshot) -> hv.KVSnapshot:
    """Keys' pages read as values and the other way round (the descriptors' roles stay right: a valid snapshot)."""
    return replace(
        snap,
        keys=tuple(replace(k, page_pool=v.page_pool) for k, v in zip(snap.keys, snap.values)),
        values=tuple(replace(v, page_pool=k.page_pool) for k, v in zip(snap.keys, snap.values)),
    )


@pytest.mark.vllm
@pytest.mark.parametrize("corrupt", [shifted_pages, swapped_kv], ids=["page-shifted-by-one", "keys-values-swapped"])
def test_the_margin_rule_refuses_wrong_kv(engine_runs, hf_model, corrupt: Any) -> None:  # type: ignore[no-untyped-def]
    """The relaxed comparison above still fails when vLLM's KV is wrong."""
    out, result = engine_runs["bf16-32"]
    bad = corrupt(hv.load(out / "snap.hrry"))
    refused = []
    for s, rid in enumerate(RIDS):
        tokens = result["outputs"][rid][2:]
        report = agreement(tfa.teacher_forced_logits(hf_model, bad, s, tokens), tokens)
        refused.append(not report.ok)
    assert all(refused), f"{corrupt.__name__}: the margin rule accepted wrong KV ({refused})"


@pytest.mark.vllm
def test_vllm_snapshot_cache_layout(engine_runs, hf_model) -> None:  # type: ignore[no-untyped-def]
    """The DynamicCache holds [1, kv_heads, seq_len, head_dim], post-RoPE, close to transformers' own KV."""
    out, _ = engine_runs["bf16-32"]
    snap = hv.load(out / "snap.hrry")
    for s in range(snap.num_seqs):
        n = snap.seq_lens[s]
        cache = tfa.to_dynamic_cache(snap, s, model_config=hf_model.config)
        ref, _ = prefill(hf_model, list(snap.token_ids[s][:n]))
        assert len(cache.layers) == snap.num_layers == len(ref.layers)
        for mine, theirs in zip(cache.layers, ref.layers):
            assert mine.keys.shape == theirs.keys.shape == (1, 2, n, 32)
            assert mine.keys.dtype == torch.bfloat16
            for a, b in ((mine.keys, theirs.keys), (mine.values, theirs.values)):
                assert ((a.float() - b.float()).abs() <= 2e-2 * (1 + b.float().abs())).all()


def fake_fp8(x: torch.Tensor, scale: float) -> torch.Tensor:
    """``x`` through vLLM's CPU fp8 cache: ``e4m3(x / scale)`` rounded toward zero, times ``scale``."""
    xf = x.float() / scale
    q = xf.to(torch.float8_e4m3fn)  # nearest
    raw = q.view(torch.uint8).clone()
    rounded_up = (q.float().abs() > xf.abs()) & ((raw & 0x7F) != 0)
    raw[rounded_up] -= 1  # one step toward zero: e4m3 magnitudes are monotonic in their bits
    return (raw.view(torch.float8_e4m3fn).float() * scale).to(x.dtype)


def store_new_tokens_as_fp8(cache: Any, kv_scales: Any) -> None:
    """Make every layer of ``cache`` store the K/V it is given as vLLM's fp8 cache does.

    vLLM writes each new token's K/V in fp8 and attends over the dequantized
    values, the new token's own included.
    """
    from transformers.cache_utils import DynamicLayer

    class Fp8DynamicLayer(DynamicLayer):
        scales = (1.0, 1.0)

        def update(self, k: torch.Tensor, v: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            return super().update(fake_fp8(k, self.scales[0]), fake_fp8(v, self.scales[1]), *args, **kwargs)

    for layer, scales in zip(cache.layers, kv_scales):
        assert type(layer) is DynamicLayer
        layer.__class__ = Fp8DynamicLayer
        layer.scales = scales


def fp8_emulated_logits(model: Any, snap: hv.KVSnapshot, s: int, tokens: list[int]) -> torch.Tensor:
    """Teacher-forced logits at ``tokens`` from a cache that stores new tokens' K/V as vLLM's fp8 cache does."""
    assert snap.kv_scales is not None
    ids, n = list(snap.token_ids[s]), snap.seq_lens[s]
    cache = tfa.to_dynamic_cache(snap, s, model_config=model.config)
    store_new_tokens_as_fp8(cache, snap.kv_scales)
    feed = ids[n:] + tokens[:-1]
    with torch.no_grad():
        o = model(
            input_ids=torch.tensor([feed]),
            position_ids=torch.arange(n, n + len(feed))[None],
            past_key_values=cache,
            use_cache=True,
        )
    return o.logits[0, len(ids) - n - 1 :].float()


@pytest.mark.vllm
def test_vllm_fp8_snapshot_continues_in_transformers(engine_runs, hf_model) -> None:  # type: ignore[no-untyped-def]
    """fp8 pools are dequantized exactly; the continuation matches vLLM as far as precision lets it.

    ``continue_generation`` keeps the tokens it generates in bf16, while vLLM
    stores them in fp8 too, so the two may part after a few steps. Checked
    here: the dequantization bit for bit, the first step's logits against a
    bf16 recompute, and, with a cache that stores new tokens as vLLM's fp8
    cache does, vLLM's tokens under the margin rule (tests/margins.py): the
    emulation rounds in PyTorch, vLLM in its kernels, and where two
    candidates are nearly tied the CPU's instruction set decides (an AMD
    machine without AMX parted from vLLM at the 8th token, 34 against 509).
    """
    out, result = engine_runs["fp8-32"]
    snap = hv.load(out / "snap.hrry")
    assert snap.kv_scales is not None
    for s, rid in enumerate(RIDS):
        vllm_tokens = result["outputs"][rid]
        ids = list(snap.token_ids[s])
        # Dequantization: stored * scale, then the model's dtype.
        cache = tfa.to_dynamic_cache(snap, s, model_config=hf_model.config)
        for i, layer in enumerate(cache.layers):
            ks, vs = snap.kv_scales[i]
            want_k = (snap[i, "key"].to_dense(s).float() * ks).to(torch.bfloat16).transpose(0, 1)
            want_v = (snap[i, "value"].to_dense(s).float() * vs).to(torch.bfloat16).transpose(0, 1)
            assert torch.equal(bits(layer.keys[0]), bits(want_k)) and torch.equal(bits(layer.values[0]), bits(want_v))
        # First step: close to transformers' bf16 recompute of the same tokens (fp8 rounding only).
        logits = tfa.next_token_logits(hf_model, snap, s)
        with torch.no_grad():
            ref = hf_model(torch.tensor([ids])).logits[0, -1].float()
        assert (logits - ref).abs().max() <= 0.1, f"{rid}: fp8 logits off by {(logits - ref).abs().max():.3f}"
        assert torch.nn.functional.cosine_similarity(logits, ref, dim=0) > 0.99
        # With new tokens stored as vLLM stores them, vLLM's tokens (margin rule).
        emulated = fp8_emulated_logits(hf_model, snap, s, vllm_tokens[2:])
        assert_agrees(emulated, vllm_tokens[2:], f"fp8-32 {rid}: fp8-emulating transformers", isa=result["isa"])


@pytest.mark.vllm
def test_the_fp8_margin_rule_refuses_a_wrong_scale(engine_runs, hf_model) -> None:  # type: ignore[no-untyped-def]
    """The relaxed fp8 comparison still fails when one layer's scales are wrong (doubled)."""
    out, result = engine_runs["fp8-32"]
    snap = hv.load(out / "snap.hrry")
    assert snap.kv_scales is not None
    bad = replace(snap, kv_scales=((snap.kv_scales[0][0] * 2, snap.kv_scales[0][1] * 2), *snap.kv_scales[1:]))
    for s, rid in enumerate(RIDS[:2]):
        tokens = result["outputs"][rid][2:]
        assert agreement(fp8_emulated_logits(hf_model, snap, s, tokens), tokens).ok
        assert not agreement(fp8_emulated_logits(hf_model, bad, s, tokens), tokens).ok, f"{rid}: wrong scale accepted"


def test_the_margin_rule_refuses_a_wrong_fp8_scale_synthetically(hf_model) -> None:  # type: ignore[no-untyped-def]
    """The fp8 rule on any CPU (vLLM's fp8 CPU cache needs AVX-512 or AMX): an fp8 snapshot made
    from transformers' own KV continues as its emulated run does, and a doubled scale is refused."""
    prompt = PROMPT[:40]
    pkv, first = prefill(hf_model, prompt)
    scales = tuple((float(layer.keys.abs().max()) / 448, float(layer.values.abs().max()) / 448) for layer in pkv.layers)
    base = tfa.from_transformers(pkv, [[*prompt, first]], model_config=hf_model.config)
    assert base.fingerprint is not None

    def fp8(t: Any, scale: float) -> Any:  # stored as fp8(x / scale), as vLLM's cache stores it
        return replace(t, page_pool=(t.page_pool.float() / scale).to(torch.float8_e4m3fn))

    snap = replace(
        base,
        keys=tuple(fp8(t, k) for t, (k, _) in zip(base.keys, scales)),
        values=tuple(fp8(t, v) for t, (_, v) in zip(base.values, scales)),
        kv_scales=scales,
        fingerprint=replace(base.fingerprint, dtype="float8_e4m3"),
    )
    # The source's tokens: greedy through the same emulation, one token per forward.
    cache = tfa.to_dynamic_cache(snap, 0, model_config=hf_model.config)
    store_new_tokens_as_fp8(cache, snap.kv_scales)
    source, feed, pos = [], [first], len(prompt)
    with torch.no_grad():
        for _ in range(10):
            o = hf_model(input_ids=torch.tensor([feed]), position_ids=torch.tensor([[pos]]), past_key_values=cache)
            source.append(int(o.logits[0, -1].argmax()))
            pos, feed = pos + 1, source[-1:]
    assert_agrees(fp8_emulated_logits(hf_model, snap, 0, source), source, "synthetic fp8: emulation vs itself")
    assert snap.kv_scales is not None
    bad = replace(snap, kv_scales=tuple((k * 2, v * 2) for k, v in snap.kv_scales))
    assert not agreement(fp8_emulated_logits(hf_model, bad, 0, source), source).ok


@pytest.mark.vllm
def test_vllm_snapshot_survives_save_and_load(engine_runs, hf_model, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    out, _ = engine_runs["bf16-32"]
    snap = hv.load(out / "snap.hrry")
    for suffix in (".hrry", ".hrrs"):
        hv.save(snap, tmp_path / f"again{suffix}")
        again = hv.load(tmp_path / f"again{suffix}")
        for s in range(len(RIDS)):
            a, b = tfa.to_dynamic_cache(snap, s), tfa.to_dynamic_cache(again, s)
            for x, y in zip(a.layers, b.layers):
                assert torch.equal(bits(x.keys), bits(y.keys)) and torch.equal(bits(x.values), bits(y.values))
            # Bit-identical caches, same model: exactly the original snapshot's continuation.
            assert tfa.continue_generation(hf_model, again, s, 10) == tfa.continue_generation(hf_model, snap, s, 10)


# ── transformers → snapshot → transformers ─────────────────────────────────


@pytest.mark.parametrize("page_size", [1, 7, 16, 64])
def test_round_trip_continues_like_an_uninterrupted_run(hf_model, page_size: int) -> None:  # type: ignore[no-untyped-def]
    expected = greedy(hf_model, PROMPT, 12)
    pkv, first = prefill(hf_model, PROMPT)
    assert first == expected[0]
    snap = hf_to_snapshot(hf_model, pkv, [[*PROMPT, first]], page_size)
    assert snap.page_size == page_size and snap.seq_lens == [len(PROMPT)]
    assert snap.keys[0].num_pages == -(-len(PROMPT) // page_size)
    assert snap.fingerprint == hv.ModelFingerprint("LlamaForCausalLM", 2, 2, 32, "bfloat16")
    assert snap.source is not None and snap.source.engine.startswith("transformers")
    # The cache comes back bit for bit.
    cache = tfa.to_dynamic_cache(snap, 0, model_config=hf_model.config)
    for mine, theirs in zip(cache.layers, pkv.layers):
        assert torch.equal(bits(mine.keys), bits(theirs.keys)) and torch.equal(bits(mine.values), bits(theirs.values))
    assert tfa.continue_generation(hf_model, snap, 0, 11) == expected[1:]


def hf_to_snapshot(model: Any, pkv: Any, token_ids: Any, page_size: int, **kw: Any) -> hv.KVSnapshot:
    snap = tfa.from_transformers(pkv, token_ids, page_size=page_size, model_config=model.config, **kw)
    assert snap.validate().ok, snap.validate().violations
    # Slots past every sequence's end are zero.
    for t in (*snap.keys, *snap.values):
        raw = t.page_pool.view(torch.uint8).reshape(t.num_pages, t.page_size, -1)
        for p, used in enumerate(t.valid_slots().tolist()):
            assert not raw[p, used:].any()
    return snap


def test_round_trip_through_files(hf_model, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    expected = greedy(hf_model, PROMPT, 8)
    pkv, first = prefill(hf_model, PROMPT)
    snap = hf_to_snapshot(hf_model, pkv, [[*PROMPT, first]], 16, request_ids=["r0"])
    for suffix in (".hrry", ".hrrs"):
        hv.save(snap, tmp_path / f"s{suffix}")
        again = hv.load(tmp_path / f"s{suffix}")
        assert again.fingerprint == snap.fingerprint and again.source == snap.source
        assert again.request_ids == ("r0",) and again.token_ids == snap.token_ids
        assert tfa.continue_generation(hf_model, again, 0, 7) == expected[1:]


def test_every_token_with_kv_recomputes_the_last(hf_model) -> None:  # type: ignore[no-untyped-def]
    """Without a pending sampled token, the last token is fed again from the others' KV.

    That one-token forward rounds differently from generate()'s prefill, so
    the comparison is the margin rule (tests/margins.py).
    """
    pkv, _ = prefill(hf_model, PROMPT)
    snap = tfa.from_transformers(pkv, [PROMPT], model_config=hf_model.config)
    expected = greedy(hf_model, PROMPT, 6)
    assert_agrees(tfa.teacher_forced_logits(hf_model, snap, 0, expected), expected, "last token recomputed")
    # teacher_forced_logits' first row is continue_generation's first step.
    first = tfa.teacher_forced_logits(hf_model, snap, 0, expected[:1])[0]
    assert torch.equal(first, tfa.next_token_logits(hf_model, snap, 0))


def test_for_generate_leaves_generate_the_last_token_to_feed() -> None:
    """Every token with KV: generate(token_ids, past_key_values=cache) finds nothing past the cache to feed and
    runs the whole prompt again over it (here: 16 where the from-scratch run picks 57, no error). ``for_generate``
    caches one token fewer, and generate() feeds the last one.

    That one-token forward is not the from-scratch prefill's arithmetic: the margin rule (tests/margins.py)
    where the tokens differ. A weak random model (initializer_range 0.02) repeats the prompt's own pattern and
    hides the bug: this one does not.
    """
    model = tiny_llama(initializer_range=0.3)
    prompt = [1, 5, 9, 12, 7, 3, 8, 20, 33, 61, 4, 2]
    pkv, first = prefill(model, prompt)
    snap = tfa.from_transformers(pkv, [prompt], model_config=model.config)
    expected = greedy(model, prompt, 6)
    cache = tfa.to_dynamic_cache(snap, 0, model_config=model.config, for_generate=True)
    assert cache.get_seq_length() == len(prompt) - 1
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]), past_key_values=cache, max_new_tokens=6, min_new_tokens=6, do_sample=False,
            pad_token_id=0,
        )  # fmt: skip
    got = [int(t) for t in out[0, len(prompt) :]]
    if got != expected:
        logits = recompute_logits(model, prompt, got)
        assert_agrees(logits, got, "generate() from a for_generate cache", dtype=torch.float32)
    # A pending token: generate() feeds it, nothing is cut; a shorter length stays as asked.
    pending = tfa.from_transformers(pkv, [[*prompt, first]], model_config=model.config)
    cache = tfa.to_dynamic_cache(pending, 0, model_config=model.config, for_generate=True)
    assert cache.get_seq_length() == len(prompt)
    cache = tfa.to_dynamic_cache(snap, 0, model_config=model.config, length=9, for_generate=True)
    assert cache.get_seq_length() == 9
    with pytest.raises(hv.HurrayFormatError) as err:  # nothing to give generate()
        tfa.to_dynamic_cache(replace(snap, token_ids=()), 0, model_config=model.config, for_generate=True)
    assert err.value.field == "snapshot.token_ids"


def test_for_generate_refuses_to_rewind_a_hybrids_states() -> None:
    """Linear-attention states hold every token: they cannot be cut by one as the KV can."""
    cfg, arch = qwen3_next_config(), "Qwen3NextForCausalLM"
    full = replace(hybrid_snapshot(), token_ids=(tuple(range(1, 8)),))  # 7 ids, 7 tokens of KV and states
    with pytest.raises(hv.HurrayArgumentError, match="cannot be rewound") as err:
        tfa.to_dynamic_cache(full, 0, model_config=cfg, architecture=arch, for_generate=True)
    assert err.value.field == "for_generate"
    pending = replace(hybrid_snapshot(), token_ids=(tuple(range(1, 9)),))  # the 8th has no KV: nothing is cut
    cache = tfa.to_dynamic_cache(pending, 0, model_config=cfg, architecture=arch, for_generate=True)
    assert cache.layers[3].keys.shape == (1, 2, 7, 16)


def test_eos_stops_generation(hf_model) -> None:  # type: ignore[no-untyped-def]
    pkv, _ = prefill(hf_model, PROMPT)
    snap = tfa.from_transformers(pkv, [PROMPT], model_config=hf_model.config)
    full = tfa.continue_generation(hf_model, snap, 0, 6)
    eos = full[2]
    assert tfa.continue_generation(hf_model, snap, 0, 6, eos_token_id=eos) == full[: full.index(eos) + 1]
    assert tfa.continue_generation(hf_model, snap, 0, 6, eos_token_id=[-1, eos]) == full[: full.index(eos) + 1]
    assert tfa.continue_generation(hf_model, snap, 0, 0) == []
    assert tfa.teacher_forced_logits(hf_model, snap, 0, []).shape == (0, hf_model.config.vocab_size)
    # The first step's logits, and grad mode left as it was.
    assert int(tfa.next_token_logits(hf_model, snap, 0).argmax()) == full[0]
    assert torch.is_grad_enabled()


LENS = [45, 30, 12]


def padded_batch(pad_left: bool) -> tuple[torch.Tensor, torch.Tensor, list[list[int]]]:
    seqs = [PROMPT[:n] if i != 2 else [17, 42, 99, 256, 8, *PROMPT[:7]] for i, n in enumerate(LENS)]
    width = max(LENS)
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    mask = torch.zeros(len(seqs), width, dtype=torch.long)
    for b, row in enumerate(seqs):
        sl = slice(width - len(row), width) if pad_left else slice(0, len(row))
        ids[b, sl], mask[b, sl] = torch.tensor(row), 1
    return ids, mask, seqs


@pytest.mark.parametrize("pad_left", [False, True], ids=["right-seq_lens", "left-attention_mask"])
def test_padded_batch(hf_model_f32, pad_left: bool) -> None:  # type: ignore[no-untyped-def]
    """A padded batch pages into per-sequence KV; each sequence continues like its own run (fp32)."""
    model = hf_model_f32
    ids, mask, seqs = padded_batch(pad_left)
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)  # positions 0..n-1 per sequence, as generate() does
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, position_ids=position_ids, use_cache=True)
    pkv = out.past_key_values
    kw: dict[str, Any] = {"attention_mask": mask} if pad_left else {"seq_lens": LENS}
    # token_ids as the padded model input: the padding is dropped.
    snap = hf_to_snapshot(model, pkv, ids, 8, **kw)
    assert snap.seq_lens == LENS and [list(t) for t in snap.token_ids] == seqs
    for b, row in enumerate(seqs):
        slots = torch.nonzero(mask[b]).reshape(-1)
        for i, layer in enumerate(pkv.layers):
            want = layer.keys[b].index_select(1, slots).transpose(0, 1)
            assert torch.equal(snap[i, "key"].to_dense(b), want)
        # A padded batch and a lone sequence round differently (other shapes): the margin rule, in fp32.
        expected = greedy(model, row, 6)
        logits = tfa.teacher_forced_logits(model, snap, b, expected)
        assert_agrees(logits, expected, f"padded batch, sequence {b}", dtype=torch.float32)


def test_identical_pages_are_shared() -> None:
    """Full pages with equal token prefixes and bit-identical KV are stored once."""
    torch.manual_seed(0)
    k, v = torch.randn(3, 2, 40, 8), torch.randn(3, 2, 40, 8)
    ids = [list(range(40)), list(range(40)), list(range(20)) + [7] * 20]
    for t in (k, v):
        t[1, :, :36] = t[0, :, :36]  # two shared pages of 16, then a differing token
        t[2, :, :20] = t[0, :, :20]  # one page
    k[1, 0, 17] += 1  # ...except that page 1 of sequence 1 differs in one key: not shared
    legacy = [(k, v), (k * 2, v * 2)]
    snap = tfa.from_transformers(legacy, ids, page_size=16)
    assert snap.keys[0].pages_of(0).tolist() == [0, 1, 2]
    assert snap.keys[0].pages_of(1).tolist() == [0, 3, 4]
    assert snap.keys[0].pages_of(2).tolist() == [0, 5, 6]
    assert snap.sharing().shared_pages == 1
    for s in range(3):
        assert torch.equal(snap[1, "value"].to_dense(s), (v[s] * 2).transpose(0, 1))
    unshared = tfa.from_transformers(legacy, ids, page_size=16, share_pages=False)
    assert unshared.keys[0].num_pages == 9 and unshared.sharing().shared_pages == 0


@pytest.mark.parametrize(
    ("mask", "kw"),
    [
        ([[0, 1, 1], [1, 1, 1]], "attention_mask"),  # left padding
        ([[1, 1, 0], [1, 1, 1]], "attention_mask"),  # right padding, by mask
        ([[1, 1, 0], [1, 1, 1]], "seq_lens"),  # right padding, by lengths
    ],
    ids=["left-mask", "right-mask", "right-seq_lens"],
)
def test_a_padded_tensor_wider_than_the_cache_keeps_the_sampled_columns(mask: list[list[int]], kw: str) -> None:
    """generate's output (the padded input, then a sampled column): the padding goes, the sampled token stays."""
    torch.manual_seed(0)
    kv = [(torch.randn(2, 2, 3, 8), torch.randn(2, 2, 3, 8)) for _ in range(2)]
    m = torch.tensor(mask)
    ids = torch.where(m.bool(), torch.tensor([[11, 12, 13], [21, 22, 23]]), 0)  # pads are token 0
    ids = torch.cat([ids, torch.tensor([[19], [29]])], dim=1)  # the sampled column, after the cache's T
    arg: dict[str, Any] = {"attention_mask": m} if kw == "attention_mask" else {"seq_lens": m.sum(1)}
    snap = tfa.from_transformers(kv, ids, page_size=2, **arg)
    own = [
        [t for t, keep in zip(row, mrow, strict=False) if keep] for row, mrow in zip(ids.tolist(), mask, strict=True)
    ]
    assert snap.seq_lens == [2, 3]
    assert [list(t) for t in snap.token_ids] == [own[0] + [19], own[1] + [29]]
    for b in range(2):  # the KV of a sequence's tokens, labelled with those tokens
        slots = torch.nonzero(m[b]).reshape(-1)
        assert torch.equal(snap[1, "key"].to_dense(b), kv[1][0][b].index_select(1, slots).transpose(0, 1))
    # The [batch, T] input itself, and per-sequence lists, give the same tokens with KV.
    assert tfa.from_transformers(kv, ids[:, :3], page_size=2, **arg).token_ids == tuple(map(tuple, own))
    assert tfa.from_transformers(kv, [own[0] + [19], own[1] + [29]], page_size=2, **arg).token_ids == snap.token_ids


def test_a_wide_tensor_with_the_same_padding_in_every_row_is_refused_as_ambiguous() -> None:
    """Every row padded alike: padded input + 1 sampled column, or unpadded rows + 2 sampled tokens? Not guessed."""
    kv = [(torch.randn(2, 2, 3, 8), torch.randn(2, 2, 3, 8))]
    mask = torch.tensor([[0, 1, 1], [0, 1, 1]])
    ids = torch.tensor([[0, 11, 12, 19], [0, 21, 22, 29]])
    with pytest.raises(hv.HurrayArgumentError) as err:
        tfa.from_transformers(kv, ids, attention_mask=mask, page_size=2)
    assert err.value.field == "token_ids" and not isinstance(err.value, hv.HurrayFormatError)
    lists = [[11, 12, 19], [21, 22, 29]]  # the way out the message names
    assert tfa.from_transformers(kv, lists, attention_mask=mask, page_size=2).token_ids == tuple(map(tuple, lists))
    # Without padding, a wide tensor is its rows: tokens with KV, then the sampled ones.
    full = tfa.from_transformers(kv, ids, page_size=2)
    assert full.token_ids == ((0, 11, 12, 19), (0, 21, 22, 29)) and full.seq_lens == [3, 3]


# ── refusals ───────────────────────────────────────────────────────────────


def small_snapshot(model: Any) -> hv.KVSnapshot:
    pkv, first = prefill(model, PROMPT[:20])
    return tfa.from_transformers(pkv, [[*PROMPT[:20], first]], model_config=model.config)


@pytest.mark.parametrize(
    "change, field",
    [
        ({"num_hidden_layers": 3}, "num_layers"),
        ({"num_key_value_heads": 4}, "num_kv_heads"),
        ({"head_dim": 16}, "head_dim"),
        ({"architectures": ["MistralForCausalLM"]}, "architecture"),
    ],
)
def test_fingerprint_mismatch_is_refused(hf_model, change: dict[str, Any], field: str) -> None:  # type: ignore[no-untyped-def]
    snap = small_snapshot(hf_model)
    cfg = hf_model.config.__class__.from_dict({**hf_model.config.to_dict(), **change})
    with pytest.raises(hv.HurrayFormatError, match=rf"does not fit this model: .*{field}") as exc:
        tfa.to_dynamic_cache(snap, 0, model_config=cfg)
    assert exc.value.field == "fingerprint"


def test_fingerprint_of_another_model_is_refused_by_continue_generation(hf_model) -> None:  # type: ignore[no-untyped-def]
    from dataclasses import replace

    snap = small_snapshot(hf_model)
    assert snap.fingerprint is not None
    other = replace(snap, fingerprint=replace(snap.fingerprint, architecture="Qwen2ForCausalLM", num_layers=4))
    with pytest.raises(hv.HurrayFormatError, match=r"architecture: snapshot has 'Qwen2ForCausalLM'.*num_layers"):
        tfa.continue_generation(hf_model, other, 0, 3)
    # Without a fingerprint the pools' own geometry is still checked.
    bare = replace(snap, fingerprint=None, keys=snap.keys[:1], values=snap.values[:1])
    with pytest.raises(hv.HurrayFormatError, match="num_layers: snapshot has 1, model has 2"):
        tfa.continue_generation(hf_model, bare, 0, 3)


def test_a_snapshot_with_a_drafters_layers_is_refused_with_the_way_to_take_the_models(hf_model) -> None:  # type: ignore[no-untyped-def]
    """An engine with EAGLE or MTP exports the drafter's layers after the model's: the refusal says what to keep."""
    from dataclasses import replace

    snap = small_snapshot(hf_model)
    assert snap.fingerprint is not None
    k, v = snap.layer_members()[0]
    draft = (replace(k, layer_index=2), replace(v, layer_index=2))
    drafted = snap.with_layers([*snap.layer_members(), draft], fingerprint=replace(snap.fingerprint, num_layers=3))
    with pytest.raises(hv.HurrayFormatError, match=r"num_layers: snapshot has 3.*layer_members\(\)\[:2\]"):
        tfa.continue_generation(hf_model, drafted, 0, 3)
    model_only = drafted.with_layers(drafted.layer_members()[:2], fingerprint=None)  # what the message says
    assert tfa.continue_generation(hf_model, model_only, 0, 3) == tfa.continue_generation(hf_model, snap, 0, 3)


def test_a_named_drafters_layers_are_dropped_even_when_the_counts_match_a_deeper_model(hf_model) -> None:  # type: ignore[no-untyped-def]
    """2 model layers + 1 drafter layer, named (extra[TARGET_LAYERS]): a 3-layer model of the same geometry must
    refuse it (2 layers against 3), not read the drafter's KV as its layer 2 and continue with wrong tokens."""
    from transformers import LlamaForCausalLM

    from hurray_vllm.kv.snapshot import TARGET_LAYERS

    snap = small_snapshot(hf_model)
    assert snap.fingerprint is not None
    k, v = snap.layer_members()[0]
    draft = (replace(k, layer_index=2), replace(v, layer_index=2))
    drafted = snap.with_layers(
        [*snap.layer_members(), draft], fingerprint=replace(snap.fingerprint, num_layers=3), extra={TARGET_LAYERS: 2}
    )
    cfg3 = hf_model.config.__class__.from_dict({**hf_model.config.to_dict(), "num_hidden_layers": 3})
    with pytest.raises(hv.HurrayFormatError, match="num_layers: snapshot has 2, model has 3") as err:
        tfa.to_dynamic_cache(drafted, 0, model_config=cfg3)
    assert err.value.field == "fingerprint"
    torch.manual_seed(0)
    with pytest.raises(hv.HurrayFormatError, match="num_layers: snapshot has 2, model has 3"):
        tfa.continue_generation(LlamaForCausalLM(cfg3).eval(), drafted, 0, 3)
    # The model it was taken with still takes its own two layers.
    assert tfa.continue_generation(hf_model, drafted, 0, 3) == tfa.continue_generation(hf_model, snap, 0, 3)


def test_from_transformers_refusals(hf_model) -> None:  # type: ignore[no-untyped-def]
    pkv, first = prefill(hf_model, PROMPT[:20])
    ids = [[*PROMPT[:20], first]]
    wrong = hv.ModelFingerprint("LlamaForCausalLM", 2, 2, 32, "float16")
    with pytest.raises(hv.HurrayFormatError, match="dtype: fingerprint has 'float16', cache has 'bfloat16'"):
        tfa.from_transformers(pkv, ids, fingerprint=wrong)
    with pytest.raises(hv.HurrayFormatError, match="19 token ids"):
        tfa.from_transformers(pkv, [PROMPT[:19]])
    # The caller's arguments that do not fit the batch: argument errors naming the argument.
    with pytest.raises(hv.HurrayArgumentError, match="not both") as err:
        tfa.from_transformers(pkv, ids, seq_lens=[20], attention_mask=torch.ones(1, 20))
    assert err.value.field == "seq_lens"
    with pytest.raises(hv.HurrayArgumentError, match="length 21") as err:
        tfa.from_transformers(pkv, ids, seq_lens=[21])
    assert err.value.field == "seq_lens"
    with pytest.raises(hv.HurrayArgumentError, match="fp8 would need scales") as err:
        tfa.from_transformers(pkv, ids, dtype=torch.float8_e4m3fn)
    assert err.value.field == "dtype"
    with pytest.raises(hv.HurrayFormatError, match="expected a transformers Cache"):
        tfa.from_transformers(object(), ids)


def test_sliding_window_layers_that_dropped_tokens_are_refused(hf_model) -> None:  # type: ignore[no-untyped-def]
    from transformers.cache_utils import DynamicCache, DynamicSlidingWindowLayer

    pkv, first = prefill(hf_model, PROMPT[:20])
    sliding = DynamicCache()
    sliding.layers = [DynamicSlidingWindowLayer(sliding_window=8) for _ in pkv.layers]
    for i, layer in enumerate(pkv.layers):
        sliding.update(layer.keys, layer.values, i)
    with pytest.raises(hv.HurrayFormatError, match="sliding-window"):
        tfa.from_transformers(sliding, [[*PROMPT[:20], first]])


def test_a_config_built_in_code_accepts_its_own_snapshot() -> None:
    """No ``architectures`` in the config: the fingerprint falls back to model_type, and the check accepts it."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                      intermediate_size=128, vocab_size=100)  # fmt: skip
    model = LlamaForCausalLM(cfg).eval()
    prompt = [1, 5, 9, 12]
    with torch.no_grad():
        out = model(torch.tensor([prompt]), use_cache=True)
    first = int(out.logits[0, -1].argmax())
    snap = tfa.from_transformers(out.past_key_values, [[*prompt, first]], model_config=cfg)
    assert snap.fingerprint is not None and snap.fingerprint.architecture == "llama"
    tokens = tfa.continue_generation(model, snap, 0, 3)
    assert [first, *tokens] == model.generate(torch.tensor([prompt]), max_new_tokens=4, do_sample=False)[0, 4:].tolist()
    other = replace(snap, fingerprint=replace(snap.fingerprint, architecture="mistral"))
    with pytest.raises(hv.HurrayFormatError, match="architecture"):
        tfa.continue_generation(model, other, 0, 1)


def test_a_sequence_declaring_more_slots_than_the_budget_is_refused_before_allocating(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """One page read 64 times is a tiny file that declares a long sequence: counted before it is expanded."""
    import hurray_vllm.kv.repage as rp

    pages = 64
    bt, ptr, lens = torch.zeros(pages, dtype=torch.int64), torch.tensor([0, pages]), torch.tensor([4 * pages])
    snap = hv.KVSnapshot(
        keys=(hv.BlockPagedTensor(torch.randn(1, 4, 1, 8), bt, ptr, lens, "key", 0),),
        values=(hv.BlockPagedTensor(torch.randn(1, 4, 1, 8), bt, ptr, lens, "value", 0),),
    )
    monkeypatch.setattr(rp, "MAX_IMPORT_SLOTS", 100)
    with pytest.raises(hv.HurrayFormatError, match="MAX_IMPORT_SLOTS"):
        tfa.to_dynamic_cache(snap, 0)  # 256 token slots
    k, _ = tfa.sequence_kv(snap, 0, 0, length=100)  # the pages of 100 tokens: 100 slots
    assert k.shape == (1, 100, 8)
    monkeypatch.setattr(rp, "MAX_IMPORT_SLOTS", 1 << 28)
    k, _ = tfa.sequence_kv(snap, 0, 0)
    assert k.shape == (1, 4 * pages, 8) and torch.equal(k[0, 4:8], k[0, :4])


def test_a_sequence_longer_than_its_pages_is_refused() -> None:
    t = hv.BlockPagedTensor(torch.randn(2, 4, 1, 8), torch.tensor([0]), torch.tensor([0, 1]), torch.tensor([10]))
    snap = hv.KVSnapshot(keys=(t,), values=(hv.BlockPagedTensor(t.page_pool, t.block_table, t.seq_ptr, t.seq_lens),))
    for read in (tfa.sequence_kv, lambda *a: tfa.to_dynamic_cache(*a[:2], dtype=torch.float32)):
        with pytest.raises(hv.HurrayFormatError) as err:  # by the format's rules, checked before any page is read
            read(snap, 0, 0)
        assert err.value.field == "shape.total_tokens"
    with pytest.raises(hv.HurrayFormatError) as err:  # and by the reader itself, should it get one unchecked
        tfa._sequence_kv(snap, 0, 0, dtype=None, length=None)
    assert err.value.field == "seq_lens.pages"


def test_kv_scales_apply_to_fp8_pools_only_as_in_every_importer() -> None:
    """A float16 snapshot carrying scales (what validate accepts): its values are taken as they are, as the
    flash-attn and FlashInfer importers take them, not multiplied by the scale."""
    from synthetic import make_snapshot

    snap = make_snapshot([6], [0], 4, heads=2, dim=8, dtype=torch.float16, layers=1)
    scaled = replace(snap, kv_scales=((2.0, 2.0),))
    plain = tfa.to_dynamic_cache(snap, 0, dtype=torch.float32, architecture="LlamaForCausalLM")
    got = tfa.to_dynamic_cache(scaled, 0, dtype=torch.float32, architecture="LlamaForCausalLM")
    assert torch.equal(plain.layers[0].keys, got.layers[0].keys)
    assert torch.equal(plain.layers[0].values, got.layers[0].values)


def test_every_layers_pools_are_checked_not_only_the_first(hf_model) -> None:  # type: ignore[no-untyped-def]
    """Layer 1 holding another model's heads (the same bytes per token) is refused before any of it is read."""
    snap = small_snapshot(hf_model)
    first, second = snap.layer_members()
    pages, size = second[0].page_pool.shape[:2]
    other = tuple(replace(t, page_pool=t.page_pool.reshape(pages, size, 1, 64)) for t in second)
    bad = snap.with_layers([first, other])
    assert [v.invariant for v in bad.validate().violations] == ["snapshot.structure"]  # validate() sees it too
    with pytest.raises(hv.HurrayFormatError, match=r"num_kv_heads: snapshot has 1.*head_dim: snapshot has 64") as err:
        tfa.check_compatible(bad, hf_model.config)
    assert err.value.field == "fingerprint" and "layer 1" in str(err.value)
    with pytest.raises(hv.HurrayFormatError, match="layer 1"):
        tfa.continue_generation(hf_model, bad, 0, 1)


def test_integer_pools_without_a_quantization_are_refused() -> None:
    """An int8 pool with no descriptor holds no values this adapter can read: refused, not cast to float."""
    from synthetic import make_snapshot

    snap = make_snapshot([6], [0], 4, heads=2, dim=8, dtype=torch.float16, layers=1)
    ints = snap.with_layers(
        [tuple(replace(t, page_pool=(t.page_pool * 50).to(torch.int8)) for t in snap.layer_members()[0])]
    )
    assert ints.validate().ok
    with pytest.raises(hv.HurrayFormatError, match=r"torch\.int8 pool without a quantization") as err:
        tfa.to_dynamic_cache(ints, 0, dtype=torch.float32)
    assert err.value.field == "dtype"
    with pytest.raises(hv.HurrayFormatError, match="quantization"):
        tfa.sequence_kv(ints, 0, 0)


def test_a_bad_length_is_refused_as_a_length_not_as_memory(hf_model) -> None:  # type: ignore[no-untyped-def]
    snap = small_snapshot(hf_model)
    for length in (snap.seq_lens[0] + 1, 10**13, -1):
        with pytest.raises(hv.HurrayArgumentError) as err:  # the caller's request, not the data
            tfa.to_dynamic_cache(snap, 0, model_config=hf_model.config, length=length)
        assert err.value.field == "length", err.value


# ── linear-attention hybrids (no engine: the configs and the states' shapes) ──


def qwen3_next_config(**change: Any) -> Any:
    """A tiny Qwen3-Next config: three gated-delta-net layers, then one attention layer."""
    from transformers import Qwen3NextConfig

    kw: dict[str, Any] = dict(
        hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
        linear_conv_kernel_dim=4, layer_types=["linear_attention"] * 3 + ["full_attention"], num_experts=4,
        num_experts_per_tok=2, intermediate_size=64, moe_intermediate_size=32, shared_expert_intermediate_size=32,
        vocab_size=128, mlp_only_layers=[0, 1, 2, 3],
    )  # fmt: skip
    return Qwen3NextConfig(**{**kw, **change})


def hybrid_snapshot(**states: Any) -> hv.KVSnapshot:
    """A snapshot shaped as vLLM exports the tiny Qwen3-Next: one attention layer's KV, three layers' states."""
    from synthetic import make_snapshot

    from hurray_vllm.kv.states import RecurrentStates

    snap = make_snapshot([7], [0], 4, heads=2, dim=16, dtype=torch.float32, layers=1)
    # conv [kernel - 1, 2 * key_heads * key_dim + value_heads * value_dim], recurrent [value_heads, key_dim, value_dim]
    tensors = tuple((torch.randn(1, 3, 128), torch.randn(1, 4, 16, 16)) for _ in range(3))
    held = RecurrentStates("gdn_attn", (0, 1, 2), ("conv", "ssm"), (7,), tensors)
    return replace(snap, states=replace(held, **states))


def test_linear_attention_states_of_another_geometry_are_refused() -> None:
    snap = hybrid_snapshot()
    assert snap.validate().ok
    tfa.check_compatible(snap, qwen3_next_config(), architecture="Qwen3NextForCausalLM")
    cache = tfa.to_dynamic_cache(snap, 0, model_config=qwen3_next_config(), architecture="Qwen3NextForCausalLM")
    assert cache.layers[0].conv_states[0].shape == (1, 128, 4) and cache.layers[3].keys.shape == (1, 2, 7, 16)
    for change, wrong in [
        ({"linear_conv_kernel_dim": 2}, r"states\.conv: snapshot has \[3, 128\], model has \[1, 128\]"),
        ({"linear_conv_kernel_dim": 6}, r"states\.conv: snapshot has \[3, 128\], model has \[5, 128\]"),
        ({"linear_num_value_heads": 2}, r"states\.conv: .* model has \[3, 96\].*states\.ssm: .* \[2, 16, 16\]"),
        ({"linear_value_head_dim": 8}, r"states\.ssm: snapshot has \[4, 16, 16\], model has \[4, 16, 8\]"),
    ]:
        with pytest.raises(hv.HurrayFormatError, match=wrong) as err:
            tfa.to_dynamic_cache(snap, 0, model_config=qwen3_next_config(**change), architecture="Qwen3NextForCausalLM")
        assert err.value.field == "fingerprint"


def test_linear_attention_states_in_an_engines_own_layout_or_one_ranks_part_are_refused() -> None:
    snap = hybrid_snapshot(layout="vllm-cuda-SD")
    with pytest.raises(hv.HurrayFormatError, match="layout 'vllm-cuda-SD'") as err:
        tfa.check_compatible(snap, qwen3_next_config(), architecture="Qwen3NextForCausalLM")
    assert err.value.field == "fingerprint"
    whole = hybrid_snapshot()
    assert whole.states is not None
    with pytest.raises(hv.HurrayFormatError, match=r"part \[0, 1, 2\].*join_states"):
        tfa.check_compatible(replace(whole, states=whole.states.take(0, 1, 2)), qwen3_next_config())


def test_linear_attention_states_need_the_models_config() -> None:
    """Where the states go is the model's (its cache's layer types): without a config, a named refusal."""
    with pytest.raises(hv.HurrayArgumentError, match="model_config") as err:
        tfa.to_dynamic_cache(hybrid_snapshot(), 0)
    assert err.value.field == "model_config"


def test_recorded_attention_layers_must_be_the_models_full_attention_layers() -> None:
    """An exporter's attention-layer indices say where each layer's KV goes: another model's are refused."""
    tfa.check_compatible(hybrid_snapshot(attention=(3,)), qwen3_next_config(), architecture="Qwen3NextForCausalLM")
    for wrong in ((4,), (5,)):  # past the model's layers (a raw IndexError from the cache, unchecked)
        snap = hybrid_snapshot(attention=wrong)
        assert snap.validate().ok
        with pytest.raises(hv.HurrayFormatError, match=rf"states: .*attention layers are model layers \[{wrong[0]}\]"):
            tfa.to_dynamic_cache(snap, 0, model_config=qwen3_next_config(), architecture="Qwen3NextForCausalLM")
    # Unvalidated (check_compatible alone): KV recorded for a linear-attention layer.
    with pytest.raises(
        hv.HurrayFormatError, match=r"model layers \[2\], the model's full-attention layers are \[3\]"
    ) as err:
        tfa.check_compatible(hybrid_snapshot(attention=(2,)), qwen3_next_config())
    assert err.value.field == "fingerprint"


def test_a_hybrids_own_states_and_kv_give_the_logits_of_its_own_cache() -> None:
    """Found by mutation testing: the conv state's zero column put at the newest end, its columns reversed, or the
    recurrent state transposed (``_put_states``) failed no test, as every test's states were random. Here
    transformers' own prefill states and KV go through a snapshot and back: the next token's logits are those
    of transformers' own cache (exactly, as the same computation runs on the same values)."""
    require("transformers")
    from transformers import Qwen3NextForCausalLM

    from hurray_vllm.kv.paged import BlockPagedTensor
    from hurray_vllm.kv.states import RecurrentStates

    torch.manual_seed(0)
    model = Qwen3NextForCausalLM(qwen3_next_config(initializer_range=0.3)).float().eval()
    ids, n = torch.randint(0, 128, (12,)).tolist(), 11  # 11 tokens with KV and states, one pending

    def own_cache() -> Any:
        with torch.no_grad():
            return model(torch.tensor([ids[:n]]), use_cache=True).past_key_values

    with torch.no_grad():
        want = model(
            torch.tensor([ids[n:]]), past_key_values=own_cache(), position_ids=torch.tensor([[n]]), use_cache=True
        ).logits[0, -1]
    cache = own_cache()
    # transformers keeps the last ``kernel`` conv inputs as [conv_dim, kernel]; the format the last kernel - 1 as
    # [kernel - 1, conv_dim]. The recurrent state is [v_heads, k_dim, v_dim] on both sides.
    states = tuple(
        (
            cache.layers[j].conv_states[0][0][:, 1:].T.unsqueeze(0).clone(),
            cache.layers[j].recurrent_states[0][0].unsqueeze(0).float().clone(),
        )
        for j in (0, 1, 2)
    )

    def paged(x: torch.Tensor, role: str) -> BlockPagedTensor:  # [H, n, D] in pages of one token
        pool = x.transpose(0, 1).reshape(n, 1, x.shape[0], x.shape[2]).contiguous()
        return BlockPagedTensor(pool, torch.arange(n), torch.tensor([0, n]), torch.tensor([n]), role, 0)

    attn = cache.layers[3]
    snap = hv.KVSnapshot.from_layers(
        [(paged(attn.keys[0], "key"), paged(attn.values[0], "value"))],
        fingerprint=hv.ModelFingerprint("Qwen3NextForCausalLM", 1, 2, 16, "float32"),
    )
    snap = replace(
        snap, token_ids=(tuple(ids),), states=RecurrentStates("gdn_attn", (0, 1, 2), ("conv", "ssm"), (n,), states)
    )
    assert snap.validate().ok
    torch.testing.assert_close(tfa.next_token_logits(model, snap, 0), want.float(), atol=1e-5, rtol=0)


def test_several_pending_tokens_advance_the_positions_by_their_count() -> None:
    """Found by mutation testing: after feeding a snapshot's pending tokens (several when it was taken mid-prefill),
    a next step placed one past the first of them, not past all, failed no test: every test had one pending token."""
    require("transformers")
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=128, initializer_range=0.3,
    )  # fmt: skip
    model = LlamaForCausalLM(cfg).float().eval()
    ids, n = torch.randint(0, 128, (11,)).tolist(), 8  # KV for 8 tokens, 3 pending
    pkv, _ = prefill(model, ids[:n])
    snap = tfa.from_transformers(pkv, [ids], page_size=4, model_config=model.config)
    assert snap.seq_lens == [n]
    # transformers' own run: all 11 tokens in one forward, then greedy steps from its own cache.
    want_tokens, want_logits = [], []
    with torch.no_grad():
        out = model(torch.tensor([ids]), use_cache=True)
        for _ in range(3):
            logits = out.logits[0, -1].float()
            want_tokens.append(int(logits.argmax()))
            want_logits.append(logits)
            out = model(torch.tensor([want_tokens[-1:]]), past_key_values=out.past_key_values, use_cache=True)
    assert tfa.continue_generation(model, snap, 0, 3) == want_tokens
    steps = tfa._greedy(model, snap, 0)
    for want in want_logits:
        torch.testing.assert_close(next(steps)[1], want, atol=1e-4, rtol=0)


def test_an_in_memory_snapshot_is_validated_before_import() -> None:
    """A block table entry past the pool: a format error naming it, not an IndexError from index_select."""
    from synthetic import make_snapshot

    snap = make_snapshot([6], [0], 4, heads=2, dim=8, dtype=torch.float32, layers=1)
    bt = snap.keys[0].block_table.clone()
    bt[1] = snap.keys[0].page_pool.shape[0] + 3
    bad = snap.with_layers([tuple(replace(t, block_table=bt) for t in snap.layer_members()[0])])
    with pytest.raises(hv.HurrayFormatError, match="to_dynamic_cache"):
        tfa.to_dynamic_cache(bad, 0, dtype=torch.float32)


def test_an_unfilled_static_cache_is_refused_as_static_not_as_sliding(hf_model) -> None:  # type: ignore[no-untyped-def]
    from transformers import StaticCache

    cache = StaticCache(config=hf_model.config, max_cache_len=32)
    with torch.no_grad():
        hf_model(torch.tensor([PROMPT[:20]]), past_key_values=cache, use_cache=True)
    with pytest.raises(hv.HurrayFormatError, match=r"StaticLayer\) is a preallocated \(static\) layer of 32 slots "
                       r"holding 20 tokens") as err:  # fmt: skip
        tfa.from_transformers(cache, [PROMPT[:20]])
    assert "sliding" not in str(err.value)


def qwen25_vl(image: int = 250, video: int = 251, *, section_in_config: bool = True) -> Any:
    """A tiny Qwen2.5-VL (M-RoPE: ``mrope_section``) in float32.

    ``section_in_config=False``: the config names no ``mrope_section`` (as
    some checkpoints' do not), and the model's rotary embedding takes its
    default one in code.
    """
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    torch.manual_seed(0)
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": 1e4}
    if section_in_config:
        rope["mrope_section"] = [2, 3, 3]
    cfg = Qwen2_5_VLConfig(
        text_config=dict(
            hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
            vocab_size=256, rope_parameters=rope,
        ),
        vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64),
        image_token_id=image, video_token_id=video, vision_start_token_id=252, vision_end_token_id=253,
    )  # fmt: skip
    return Qwen2_5_VLForConditionalGeneration(cfg).eval()


def test_an_m_rope_sequence_with_images_is_refused_and_text_only_continues() -> None:
    """After image or video tokens an M-RoPE model's positions are not the token count (vLLM's mrope_delta)."""
    model = qwen25_vl()
    prompt = [(i * 37 + 11) % 200 + 1 for i in range(12)]
    with torch.no_grad():
        out = model(torch.tensor([prompt]), use_cache=True)
    first = int(out.logits[0, -1].argmax())
    text = tfa.from_transformers(out.past_key_values, [[*prompt, first]], model_config=model.config)
    unmoved = model.generate(torch.tensor([prompt]), max_new_tokens=4, do_sample=False)[0, len(prompt) :].tolist()
    assert [first, *tfa.continue_generation(model, text, 0, 3)] == unmoved
    for media in (250, 251):
        ids = [*prompt[:4], 252, media, 253, *prompt[7:], first]
        snap = replace(text, token_ids=(tuple(ids),))
        with pytest.raises(hv.HurrayFormatError, match=rf"image/video tokens \[{media}\].*mrope_delta") as err:
            tfa.continue_generation(model, snap, 0, 3)
        assert err.value.field == "snapshot.token_ids"


def test_an_m_rope_model_whose_config_names_no_section_is_known_by_its_modules() -> None:
    """Qwen2-VL/2.5-VL/3-VL and GLM-4V default mrope_section in code: the model's rotary embedding says M-RoPE."""
    from synthetic import make_snapshot

    model = qwen25_vl(section_in_config=False)
    assert "mrope_section" not in (model.config.get_text_config(decoder=True).rope_parameters or {})
    prompt = [(i * 37 + 11) % 200 + 1 for i in range(12)]
    ids = (*prompt[:4], 252, 250, 253, *prompt[7:])  # refused before any forward: synthetic KV of the model's shape
    snap = replace(make_snapshot([12], [0], 4, heads=2, dim=16, dtype=torch.float32, layers=2), token_ids=(ids,))
    with pytest.raises(hv.HurrayFormatError, match=r"image/video tokens \[250\].*mrope_delta") as err:
        tfa.continue_generation(model, snap, 0, 3)
    assert err.value.field == "snapshot.token_ids"


# ── layer types, head slices, shared KV, devices, dtypes ───────────────────


def tiny_llama(**change: Any) -> Any:
    """A tiny random Llama in float32, built from a config (no checkpoint)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    kw: dict[str, Any] = dict(
        num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
        vocab_size=100,
    )  # fmt: skip
    return LlamaForCausalLM(LlamaConfig(**{**kw, **change})).eval()


def test_layers_of_a_type_the_adapter_does_not_move_are_refused() -> None:
    """DeepSeek-V4's compressed attention layers cache compressed KV and compressor state, not a snapshot's KV:
    loaded as plain KV they would continue with wrong tokens, so the model is refused by its layer types."""
    from synthetic import make_snapshot

    tr = require("transformers")
    if not hasattr(tr, "DeepseekV4Config"):
        pytest.skip("this transformers has no DeepSeek-V4")
    cfg = tr.DeepseekV4Config(
        hidden_size=64, num_hidden_layers=4, num_attention_heads=4, head_dim=32, vocab_size=128, intermediate_size=64,
        moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2, q_lora_rank=32, index_head_dim=16,
        index_n_heads=2, sliding_window=8,
    )  # fmt: skip
    snap = make_snapshot([20], [0], 16, heads=1, dim=32, dtype=torch.float32, layers=4)  # the config's geometry
    with pytest.raises(hv.HurrayFormatError, match=r"'heavily_compressed_attention' layers \(layer_types\[0\]") as err:
        tfa.check_compatible(snap, cfg, architecture="DeepseekV4ForCausalLM")
    assert err.value.field == "model_config" and "compressed_sparse_attention" in str(err.value)
    with pytest.raises(hv.HurrayFormatError, match="heavily_compressed_attention") as err:
        tfa.to_dynamic_cache(snap, 0, model_config=cfg, architecture="DeepseekV4ForCausalLM")
    assert err.value.field == "model_config"
    kv = [(torch.randn(1, 1, 5, 32), torch.randn(1, 1, 5, 32))] * 4
    with pytest.raises(hv.HurrayFormatError, match="heavily_compressed_attention") as err:
        tfa.from_transformers(kv, [[1] * 5], model_config=cfg)
    assert err.value.field == "model_config"


def test_chunked_attention_layers_continue_from_every_tokens_kv() -> None:
    """Llama 4's chunked layers: transformers' cache keeps the current chunk of the KV it is given, as it
    would have kept from a prefill, so a snapshot of every token continues as the model does."""
    tr = require("transformers")
    torch.manual_seed(0)
    cfg = tr.Llama4TextConfig(
        hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        intermediate_size=64, intermediate_size_mlp=128, vocab_size=128, num_local_experts=2, attention_chunk_size=8,
        no_rope_layers=[1, 1, 1, 0],
    )  # fmt: skip
    assert "chunked_attention" in cfg.layer_types
    model = tr.Llama4ForCausalLM(cfg).eval()
    prompt = [(i * 37 + 11) % 120 + 1 for i in range(13)]  # past the first chunk of 8
    with torch.no_grad():  # a cache built without the config keeps every token (what a snapshot holds)
        out = model(torch.tensor([prompt]), use_cache=True, past_key_values=tr.DynamicCache())
    first = int(out.logits[0, -1].argmax())
    snap = tfa.from_transformers(out.past_key_values, [[*prompt, first]], model_config=cfg)
    unmoved = model.generate(torch.tensor([prompt]), max_new_tokens=7, do_sample=False)[0, len(prompt) :].tolist()
    assert [first, *tfa.continue_generation(model, snap, 0, 6)] == unmoved
    assert len(set(unmoved)) > 2


def test_one_tensor_parallel_ranks_heads_are_refused_with_the_way_to_join_them() -> None:
    """A rank's slice of the KV heads (snapshot.heads) is not the model's KV, whatever its fingerprint says."""
    model = tiny_llama()
    prompt = [1, 5, 9, 12, 7, 3]
    pkv, first = prefill(model, prompt)
    snap = tfa.from_transformers(pkv, [[*prompt, first]])  # no fingerprint: the pools' 2 heads fit the model
    part = replace(snap, heads=hv.HeadRange(0, 2, 4))  # ...but they are heads 0..1 of another model's 4
    assert part.validate().ok
    with pytest.raises(
        hv.HurrayFormatError, match=r"heads 0\.\.1 of 4 .*concat_heads.*4 KV heads, the model has 2"
    ) as err:
        tfa.continue_generation(model, part, 0, 3)
    assert err.value.field == "fingerprint"
    # Of the model with 4 KV heads, fingerprint and all: the slice, not the head count, is what is wrong.
    four = tiny_llama(num_key_value_heads=4, architectures=["LlamaForCausalLM"]).config
    fp = hv.ModelFingerprint("LlamaForCausalLM", 2, 4, 16, "float32")
    with pytest.raises(hv.HurrayFormatError, match=r"tensor-parallel rank's part\); join .*concat_heads"):
        tfa.to_dynamic_cache(replace(part, fingerprint=fp), 0, model_config=four)
    # Every head, recorded as such: accepted.
    assert tfa.continue_generation(model, replace(snap, heads=hv.HeadRange(0, 2, 2)), 0, 3) == tfa.continue_generation(
        model, snap, 0, 3
    )


def test_caller_mistakes_are_argument_errors_naming_the_argument() -> None:
    """The caller's indices and options: HurrayArgumentError (and still a HurrayFormatError or IndexError where
    they were one), never a bare IndexError from deep inside."""
    from synthetic import make_snapshot

    snap = make_snapshot([6], [0], 4, heads=2, dim=8, dtype=torch.float32, layers=1)
    for call, field in [
        (lambda: tfa.sequence_kv(snap, 5, 0), "seq"),
        (lambda: tfa.sequence_kv(snap, -1, 0), "seq"),
        (lambda: tfa.to_dynamic_cache(snap, -1), "seq"),
        (lambda: tfa.sequence_kv(snap, 0, 3), "layer"),
        (lambda: tfa.sequence_kv(snap, 0, 0, length=7), "length"),
        (lambda: tfa.to_dynamic_cache(snap, 0, length=99), "length"),
    ]:
        with pytest.raises(hv.HurrayArgumentError) as err:
            call()
        assert err.value.field == field, err.value
        if field == "seq":
            assert isinstance(err.value, IndexError)  # what it was before
    k = torch.randn(1, 2, 5, 8)
    for kw, field in [
        ({"page_size": 0}, "page_size"),
        ({"dtype": torch.int8}, "dtype"),
        ({"request_ids": ["a", "b"]}, "request_ids"),
        ({"seq_lens": [5, 5]}, "seq_lens"),
        ({"attention_mask": torch.ones(1, 4)}, "attention_mask"),
    ]:
        with pytest.raises(hv.HurrayArgumentError) as err:
            tfa.from_transformers([(k, k)], [[1] * 5], **kw)
        assert err.value.field == field, err.value
    with pytest.raises(hv.HurrayArgumentError) as err:
        tfa.continue_generation(tiny_llama(), snap, 0, -1)
    assert err.value.field == "max_new_tokens"


def test_sequence_kv_validates_the_snapshot_as_to_dynamic_cache_does() -> None:
    """A block table entry past the pool: a format error naming it, not an IndexError from index_select."""
    from synthetic import make_snapshot

    snap = make_snapshot([6], [0], 4, heads=2, dim=8, dtype=torch.float32, layers=1)
    bt = snap.keys[0].block_table.clone()
    bt[1] = snap.keys[0].page_pool.shape[0] + 3
    bad = snap.with_layers([tuple(replace(t, block_table=bt) for t in snap.layer_members()[0])])
    with pytest.raises(hv.HurrayFormatError, match="sequence_kv") as err:
        tfa.sequence_kv(bad, 0, 0)
    assert not isinstance(err.value, hv.HurrayArgumentError)


def test_a_model_whose_last_layers_share_kv_round_trips() -> None:
    """Gemma3n's last num_kv_shared_layers attend over earlier layers' caches and have none of their own:
    its cache, and so its snapshot, hold the other layers."""
    tr = require("transformers")
    torch.manual_seed(0)
    cfg = tr.Gemma3nTextConfig(
        hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        intermediate_size=128, vocab_size=128, vocab_size_per_layer_input=128, hidden_size_per_layer_input=8,
        num_kv_shared_layers=2, sliding_window=8, layer_types=["sliding_attention", "full_attention"] * 2,
        laurel_rank=8, altup_num_inputs=2, activation_sparsity_pattern=[0.0] * 4,
    )  # fmt: skip
    model = tr.Gemma3nForCausalLM(cfg).eval()
    assert tfa.config_geometry(cfg).num_layers == 2
    prompt = [(i * 37 + 11) % 120 + 1 for i in range(7)]
    pkv, first = prefill(model, prompt)
    assert len(pkv.layers) == 2
    snap = tfa.from_transformers(pkv, [[*prompt, first]], model_config=cfg)
    assert snap.num_layers == 2 and snap.fingerprint is not None and snap.fingerprint.num_layers == 2
    with torch.no_grad():
        full = model(torch.tensor([[*prompt, first]])).logits[0, -1].float()
    torch.testing.assert_close(tfa.next_token_logits(model, snap, 0), full, rtol=0, atol=1e-4)
    unmoved = model.generate(torch.tensor([prompt]), max_new_tokens=5, do_sample=False)[0, len(prompt) :].tolist()
    assert [first, *tfa.continue_generation(model, snap, 0, 4)] == unmoved


def test_each_layers_cache_goes_to_its_layers_device() -> None:
    """A model split across devices (device_map) attends each layer where its weights are: its cache goes there.

    This machine has one device, so the second is ``meta`` (shapes only).
    """
    model = tiny_llama()
    prompt = [1, 5, 9, 12, 7, 3]
    pkv, first = prefill(model, prompt)
    snap = tfa.from_transformers(pkv, [[*prompt, first]], model_config=model.config)
    cache = tfa.to_dynamic_cache(snap, 0, model_config=model.config, device=["cpu", "meta"])
    assert [layer.keys.device.type for layer in cache.layers] == ["cpu", "meta"]
    assert [layer.values.device.type for layer in cache.layers] == ["cpu", "meta"]
    with pytest.raises(hv.HurrayArgumentError) as err:
        tfa.to_dynamic_cache(snap, 0, model_config=model.config, device=["cpu"])
    assert err.value.field == "device"
    # The model's own placement, as continue_generation loads it: layer 1's weights on the other device.
    assert tfa._layer_devices(model) is None  # one device: the cache goes where the first weights are
    model.model.layers[1].to("meta")
    assert [d.type for d in tfa._layer_devices(model) or []] == ["cpu", "meta"]
    cache, *_ = tfa._resume(model, snap, 0)
    assert [layer.keys.device.type for layer in cache.layers] == ["cpu", "meta"]
    # A hybrid's states go to their layer's device too.
    devices = ["cpu", "meta", "cpu", "meta"]
    cache = tfa.to_dynamic_cache(
        hybrid_snapshot(), 0, model_config=qwen3_next_config(), architecture="Qwen3NextForCausalLM", device=devices
    )
    assert cache.layers[1].conv_states[0].device.type == "meta" and cache.layers[2].conv_states[0].device.type == "cpu"
    assert cache.layers[3].keys.device.type == "meta"


def test_without_dtype_the_cache_takes_the_models_dtype_from_its_config() -> None:
    """A float32 snapshot for a bf16 model: a cache in the pools' dtype would fail the model's attention."""
    model = tiny_llama()
    prompt = [1, 5, 9, 12, 7, 3]
    pkv, first = prefill(model, prompt)
    snap = tfa.from_transformers(pkv, [[*prompt, first]], model_config=model.config)  # float32 pools
    model = model.to(torch.bfloat16)
    model.config.dtype = torch.bfloat16
    cache = tfa.to_dynamic_cache(snap, 0, model_config=model.config)
    assert cache.layers[0].keys.dtype == torch.bfloat16
    with torch.no_grad():
        model(input_ids=torch.tensor([[first]]), position_ids=torch.tensor([[6]]), past_key_values=cache)
    model.config.dtype = "float16"  # as a config read from JSON names it
    assert tfa.to_dynamic_cache(snap, 0, model_config=model.config).layers[0].keys.dtype == torch.float16
    assert tfa.to_dynamic_cache(snap, 0).layers[0].keys.dtype == torch.float32  # without a config: the pools'


def gemma4_config(**change: Any) -> Any:
    """A tiny Gemma 4 text config; by default its full-attention layers take global_head_dim 32, the others 16."""
    tr = require("transformers")
    if not hasattr(tr, "Gemma4TextConfig"):
        pytest.skip(f"transformers {tr.__version__} has no Gemma 4 (per_layer_config)")
    kw: dict[str, Any] = dict(
        hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        global_head_dim=32, intermediate_size=128, vocab_size=128, max_position_embeddings=512, sliding_window=8,
        layer_types=["sliding_attention", "full_attention"] * 2, vocab_size_per_layer_input=128,
        hidden_size_per_layer_input=8,
    )  # fmt: skip
    return tr.Gemma4TextConfig(**{**kw, **change})


def test_per_layer_kv_geometry_is_refused_as_the_models_config_and_a_uniform_one_is_read() -> None:
    """Gemma 4's per_layer_config gives its full-attention layers another head_dim: transformers refuses the global
    read with its own RuntimeError, which escaped every entry point. A snapshot has one KV geometry: refused, naming
    the config; layers that all agree (here every one overridden alike) are read per layer and round-trip."""
    from synthetic import make_snapshot

    cfg = gemma4_config()
    snap = make_snapshot([6], [0], 4, heads=2, dim=16, dtype=torch.float32, layers=4)
    k = torch.randn(1, 2, 6, 16)
    for call in [
        lambda: tfa.config_geometry(cfg),
        lambda: tfa.fingerprint_from_config(cfg, dtype=torch.float32),
        lambda: tfa.check_compatible(snap, cfg),
        lambda: tfa.to_dynamic_cache(snap, 0, model_config=cfg),
        lambda: tfa.from_transformers([(k, k)] * 4, [[1] * 6], model_config=cfg),
    ]:
        with pytest.raises(hv.HurrayFormatError, match=r"per-layer KV geometry .*head_dim differs") as err:
            call()
        assert err.value.field == "model_config"
    kv_heads = gemma4_config(global_head_dim=16, num_global_key_value_heads=1, attention_k_eq_v=True)
    with pytest.raises(hv.HurrayFormatError, match="num_key_value_heads differs") as err:
        tfa.config_geometry(kv_heads)
    assert err.value.field == "model_config"

    from transformers import Gemma4ForCausalLM

    uniform = gemma4_config(per_layer_config={i: {"head_dim": 32} for i in range(4)})  # global head_dim stays 16
    assert tfa.config_geometry(uniform).head_dim == 32
    torch.manual_seed(0)
    model = Gemma4ForCausalLM(uniform).eval()
    prompt = [(i * 37 + 11) % 120 + 1 for i in range(6)]
    pkv, first = prefill(model, prompt)
    snap = tfa.from_transformers(pkv, [[*prompt, first]], model_config=uniform)
    assert snap.fingerprint is not None and snap.fingerprint.head_dim == 32
    unmoved = model.generate(torch.tensor([prompt]), max_new_tokens=4, do_sample=False)[0, len(prompt) :].tolist()
    assert [first, *tfa.continue_generation(model, snap, 0, 3)] == unmoved


def test_a_snapshot_of_a_config_built_in_code_fits_the_model_once_saved_and_loaded(tmp_path: Path) -> None:
    """The fingerprint names the model_type ('llama') when the config names no architectures; saved, the same
    model names its class (save_pretrained sets architectures), and loaded it has them: still the same model."""
    from transformers import LlamaForCausalLM

    model = tiny_llama()
    prompt = [1, 5, 9, 12, 7, 3]
    pkv, first = prefill(model, prompt)
    snap = tfa.from_transformers(pkv, [[*prompt, first]], model_config=model.config)
    assert snap.fingerprint is not None and snap.fingerprint.architecture == "llama"
    want = tfa.continue_generation(model, snap, 0, 3)
    model.save_pretrained(tmp_path)
    assert model.config.architectures == ["LlamaForCausalLM"]
    assert tfa.continue_generation(model, snap, 0, 3) == want
    loaded = LlamaForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert tfa.continue_generation(loaded, snap, 0, 3) == want
    # The other way round: a snapshot naming the class, a caller naming the model_type.
    named = replace(snap, fingerprint=replace(snap.fingerprint, architecture="LlamaForCausalLM"))
    tfa.check_compatible(named, loaded.config, architecture="llama")
    # Another model is still another model, whichever name either side gives.
    for other, arch in [("mistral", None), ("MistralForCausalLM", None), ("MistralForCausalLM", "llama")]:
        wrong = replace(snap, fingerprint=replace(snap.fingerprint, architecture=other))
        with pytest.raises(hv.HurrayFormatError, match="architecture") as err:
            tfa.check_compatible(wrong, loaded.config, architecture=arch)
        assert err.value.field == "fingerprint"


@pytest.mark.parametrize("dtype", [torch.int8, torch.int32, torch.bool, torch.float8_e4m3fn, "float16"])
def test_a_dtype_that_cannot_hold_the_kv_is_refused_not_truncated(dtype: Any) -> None:
    """An integer or bool cache held the KV truncated to 0/1 without a word; a name failed with an AttributeError."""
    from synthetic import make_snapshot

    snap = make_snapshot([6], [0], 4, heads=2, dim=8, dtype=torch.float32, layers=1)
    for call in [
        lambda: tfa.to_dynamic_cache(snap, 0, dtype=dtype),
        lambda: tfa.sequence_kv(snap, 0, 0, dtype=dtype),
    ]:
        with pytest.raises(hv.HurrayArgumentError) as err:
            call()
        assert err.value.field == "dtype", err.value


def test_argument_types_are_argument_errors_naming_the_argument() -> None:
    """Floats and strings for counts, a tensor of eos ids (which never stopped generation), a negative margin."""
    model = tiny_llama()
    prompt = [1, 5, 9, 12, 7, 3]
    pkv, first = prefill(model, prompt)
    snap = tfa.from_transformers(pkv, [[*prompt, first]], model_config=model.config)
    for kw, field in [
        ({"page_size": 2.5}, "page_size"),
        ({"page_size": True}, "page_size"),
        ({"dtype": "float16"}, "dtype"),
    ]:
        with pytest.raises(hv.HurrayArgumentError) as err:
            tfa.from_transformers(pkv, [[*prompt, first]], **kw)
        assert err.value.field == field, err.value
    for n in (2.5, "3", True):
        with pytest.raises(hv.HurrayArgumentError) as err:
            tfa.continue_generation(model, snap, 0, n)  # type: ignore[arg-type]
        assert err.value.field == "max_new_tokens"
    full = tfa.continue_generation(model, snap, 0, 5)
    eos = full[1]
    for ids in (torch.tensor(eos), torch.tensor([eos]), torch.tensor([-1, eos]), [torch.tensor(eos)]):
        assert tfa.continue_generation(model, snap, 0, 5, eos_token_id=ids) == full[: full.index(eos) + 1]
    for bad in (2.5, "7", torch.tensor([1.0])):
        with pytest.raises(hv.HurrayArgumentError) as err:
            tfa.continue_generation(model, snap, 0, 5, eos_token_id=bad)  # type: ignore[arg-type]
        assert err.value.field == "eos_token_id"
    with pytest.raises(hv.HurrayArgumentError) as err:
        tfa.check_continuation(model, snap, 0, full[:2], ulps=-1)
    assert err.value.field == "ulps"
    # Indices and lengths, each in range were it a number: a float or a bool failed deep inside (a bare TypeError,
    # IndexError or ValueError) or was taken as 0 or 1; numpy's integers and a 0-d integer tensor are integers.
    for call, field in [
        (lambda: tfa.continue_generation(model, snap, 0.0, 2), "seq"),
        (lambda: tfa.continue_generation(model, snap, False, 2), "seq"),
        (lambda: tfa.teacher_forced_logits(model, snap, 0.0, full[:1]), "seq"),
        (lambda: tfa.to_dynamic_cache(snap, 0.0, model_config=model.config), "seq"),
        (lambda: tfa.to_dynamic_cache(snap, 0, model_config=model.config, length=2.5), "length"),
        (lambda: tfa.to_dynamic_cache(snap, 0, model_config=model.config, length="3"), "length"),
        (lambda: tfa.to_dynamic_cache(snap, 0, model_config=model.config, length=True), "length"),
        (lambda: tfa.sequence_kv(snap, 0, 0, length=2.5), "length"),
        (lambda: tfa.sequence_kv(snap, 0.0, 0), "seq"),
        (lambda: tfa.sequence_kv(snap, 0, 1.0), "layer"),
        (lambda: tfa.sequence_kv(snap, 0, True), "layer"),
    ]:
        with pytest.raises(hv.HurrayArgumentError, match="must be an integer") as err:
            call()
        assert err.value.field == field, err.value
        if field == "seq":
            assert isinstance(err.value, IndexError)  # as an index out of range is
    import numpy as np

    assert tfa.continue_generation(model, snap, np.int64(0), 5) == full
    keys, _ = tfa.sequence_kv(snap, torch.tensor(0), np.int64(1), length=np.int64(3))
    assert keys.shape[1] == 3
    # A float length was truncated (2.9 -> 2) without a word.
    for lens in ([2.9], [True], torch.tensor([3.0])):
        with pytest.raises(hv.HurrayArgumentError) as err:
            tfa.from_transformers(pkv, [prompt], seq_lens=lens)
        assert err.value.field == "seq_lens", err.value
    assert tfa.from_transformers(pkv, [prompt], seq_lens=[np.int64(4)]).seq_lens == [4]


def test_token_ids_outside_the_vocabulary_are_refused_before_the_embedding() -> None:
    """Another tokenizer's ids indexed past the embedding: an IndexError on the CPU, a device-side assert that
    breaks the context on CUDA. Refused by name: the snapshot's ids to feed, or teacher_forced_logits' tokens."""
    model = tiny_llama()  # vocab_size=100
    prompt = [1, 5, 9, 12, 7, 3]
    pkv, first = prefill(model, prompt)
    for ids in ([*prompt, 100], [*prompt[:-1], 105]):  # a pending token, the last one recomputed
        snap = tfa.from_transformers(pkv, [ids], model_config=model.config)
        for call in (
            lambda s: tfa.continue_generation(model, s, 0, 2),
            lambda s: tfa.next_token_logits(model, s, 0),
            lambda s: tfa.teacher_forced_logits(model, s, 0, [first]),
        ):
            with pytest.raises(hv.HurrayFormatError, match="outside the model's vocabulary of 100") as err:
                call(snap)
            assert err.value.field == "snapshot.token_ids"
    snap = tfa.from_transformers(pkv, [[*prompt, first]], model_config=model.config)
    for tokens in ([first, 100], [-1, first]):
        with pytest.raises(hv.HurrayArgumentError, match="vocabulary of 100") as err:
            tfa.teacher_forced_logits(model, snap, 0, tokens)
        assert err.value.field == "tokens"
    assert tfa.teacher_forced_logits(model, snap, 0, [first, 99]).shape == (2, 100)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_cache_spread_over_devices_pages_each_layer_where_it_lies() -> None:
    """A device_map model's cache: layer 0 on the GPU, the next on the CPU (offloaded) or a second GPU. The gather
    indices went to layer 0's device only, and the other layers refused them with a bare RuntimeError."""
    model = tiny_llama(num_hidden_layers=3)
    prompt = [1, 5, 9, 12, 7, 3]
    pkv, first = prefill(model, prompt)
    devices = ["cuda:0", "cpu", "cuda:1" if torch.cuda.device_count() > 1 else "cuda:0"]
    spread = [(layer.keys.to(d), layer.values.to(d)) for layer, d in zip(pkv.layers, devices)]
    snap = tfa.from_transformers(spread, [[*prompt, first]], page_size=4, model_config=model.config)
    here = tfa.from_transformers(pkv, [[*prompt, first]], page_size=4, model_config=model.config)
    for i, d in enumerate(devices):
        for role in ("key", "value"):
            assert snap[i, role].page_pool.device == torch.device(d)
            assert torch.equal(snap[i, role].page_pool.cpu(), here[i, role].page_pool)


def test_a_huge_page_size_is_refused_as_the_page_size_before_allocating(monkeypatch: pytest.MonkeyPatch) -> None:
    """Five tokens in pages of 2**40 asked for 17.6 TB (a bare RuntimeError), smaller huge pages really took GBs:
    the page size is refused against MAX_IMPORT_SLOTS and the device's memory, as repaging refuses it."""
    import hurray_vllm.kv.repage as rp

    k = torch.randn(2, 2, 5, 8)
    ids = [[1] * 5, [2] * 5]
    with pytest.raises(hv.ImportArgumentError, match="MAX_IMPORT_SLOTS") as err:
        tfa.from_transformers([(k, k)], ids, page_size=2**40)
    assert err.value.field == "page_size"
    # Under the slot budget, but more bytes than the device has: still the page size when the tokens would fit.
    monkeypatch.setattr(rp, "device_memory", lambda device: 1 << 20)
    with pytest.raises(hv.ImportArgumentError, match="smaller") as err:
        tfa.from_transformers([(k, k)], ids, page_size=2**16)
    assert err.value.field == "page_size"
    assert tfa.from_transformers([(k, k)], ids, page_size=4).seq_lens == [5, 5]
    # Tokens that do not fit whatever the page size: the machine's limit, as check_memory says everywhere.
    monkeypatch.setattr(rp, "device_memory", lambda device: 64)
    with pytest.raises(OSError, match="would allocate"):
        tfa.from_transformers([(k, k)], ids, page_size=1)


@pytest.mark.parametrize("bad", [1.5, "5", True, "a", 2.0])
def test_token_ids_that_are_not_integers_are_refused_naming_token_ids(bad: object) -> None:
    """int() took 1.5 as 1 and "5" or True as token ids (the chunks were keyed by other tokens), 'a' a bare
    ValueError."""
    k = torch.randn(2, 2, 5, 8)
    with pytest.raises(hv.HurrayArgumentError) as err:
        tfa.from_transformers([(k, k)], [[1, 2, bad, 3, 4], list(range(5))])
    assert err.value.field == "token_ids" and repr(bad) in str(err.value)
    with pytest.raises(hv.HurrayArgumentError) as err:
        tfa.from_transformers([(k, k)], torch.zeros(2, 5))  # a float tensor: ids cast from floats somewhere
    assert err.value.field == "token_ids"
    ids = [[1, 2, 3, 4, 5], list(range(5))]
    assert tfa.from_transformers([(k, k)], torch.tensor(ids)).token_ids == tuple(map(tuple, ids))
