"""``hurray-vllm demo``: the format round trip on the specification's own example.

The spec's example (layer 3, page_size 4, 5 pages, 2 heads x 8, float16,
sequences of 6 and 3 tokens sharing page 0) is extended to a 4-layer
snapshot, written as a ``.hrry`` file and as a stream, read back, checked
element by element, validated, and converted.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import torch

from ..containers.check import validate
from ..containers.io import load, save
from ..kv.paged import BlockPagedTensor
from ..kv.snapshot import KVSnapshot, ModelFingerprint, SnapshotSource
from ..wire.descriptor import encode_descriptor


def spec_example_snapshot(num_layers: int = 4) -> KVSnapshot:
    """The spec's example geometry for every layer, with index-coded values."""
    table = torch.tensor([0, 1, 0])
    seq_ptr = torch.tensor([0, 2, 3])
    seq_lens = torch.tensor([6, 3])
    keys, values = [], []
    for layer in range(num_layers):
        base = torch.arange(5 * 4 * 2 * 8, dtype=torch.float32).reshape(5, 4, 2, 8) / 64
        k = BlockPagedTensor((base + layer).half(), table, seq_ptr, seq_lens, "key", layer)
        v = BlockPagedTensor((-base - layer).half(), table, seq_ptr, seq_lens, "value", layer)
        keys.append(k.zero_unused_slots())
        values.append(v.zero_unused_slots())
    return KVSnapshot(
        keys=tuple(keys),
        values=tuple(values),
        token_ids=((11, 12, 13, 14, 15, 16, 17), (11, 12, 13, 14)),
        fingerprint=ModelFingerprint("SpecExample", num_layers, 2, 8, "float16"),
        source=SnapshotSource("spec-example", "interchange", 4),
        request_ids=("seq-0", "seq-1"),
    )


def _same(a: KVSnapshot, b: KVSnapshot) -> bool:
    for la, lb in zip((*a.keys, *a.values), (*b.keys, *b.values)):
        for s in range(la.num_seqs):
            if not torch.equal(la.to_dense(s), lb.to_dense(s)):
                return False
    return a.token_ids == b.token_ids and a.fingerprint == b.fingerprint


def run_format_demo(workdir: Path | None = None, *, quiet: bool = False) -> int:
    with tempfile.TemporaryDirectory() as tmp:
        out = workdir or Path(tmp)
        out.mkdir(parents=True, exist_ok=True)
        snap = spec_example_snapshot()
        desc = encode_descriptor(snap[3, "key"].descriptor())
        checks: list[tuple[str, bool]] = []
        checks.append(("layer 3 key descriptor is the spec's 133 bytes", len(desc) == 133))
        # Element lookup by the spec formula == to_dense.
        k = snap[3, "key"]
        ok = all(
            torch.equal(k.lookup(s, t, h, d), k.to_dense(s)[t, h, d])
            for s in range(2)
            for t in range(int(k.seq_lens[s]))  # type: ignore[index]
            for h in range(2)
            for d in range(8)
        )
        checks.append(("element lookup formula matches to_dense", ok))
        sizes = {}
        for suffix in (".hrry", ".hrrs"):
            path = out / f"spec-example{suffix}"
            t0 = time.perf_counter()
            sizes[suffix] = save(snap, path)
            back = load(path)
            dt = time.perf_counter() - t0
            checks.append(
                (f"{suffix} round trip is exact ({sizes[suffix]} bytes, {dt * 1e3:.1f} ms)", _same(snap, back))
            )
            checks.append((f"{suffix} validates", validate(path).ok))
        stats = snap.sharing()
        if not quiet:
            print("hurray-vllm demo: the block-paged spec example, 4 layers")
            print(f"  layer 3 key descriptor ({len(desc)} bytes): {desc.hex()}")
            print(
                f"  sequences: {snap.seq_lens} tokens; logical pages {stats.logical_pages}, "
                f"physical {stats.distinct_pages}, shared {stats.shared_pages}"
            )
            print(f"  files in {out}")
            print()
            width = max(len(c) for c, _ in checks)
            for c, passed in checks:
                print(f"  {c:<{width}}  {'ok' if passed else 'FAILED'}")
        return 0 if all(p for _, p in checks) else 1


# ── the main job: vLLM -> Hurray -> vLLM, flash-attn and transformers ────────


def _tiny_llama(path: Path) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    if (path / "config.json").exists():
        return path
    torch.manual_seed(0)
    cfg = LlamaConfig(
        num_hidden_layers=4,
        hidden_size=256,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=32,
        intermediate_size=512,
        vocab_size=512,
        max_position_embeddings=1024,
    )
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(path)  # type: ignore[arg-type]
    return path


DEMO_BLOCK = 32
DEMO_STEPS = 6  # decode steps before the snapshot
DEMO_TOKENS = 16  # tokens generated in total


def demo_prompts() -> dict[str, list[int]]:
    """Three requests sharing a 96-token system prompt (3 blocks of 32)."""
    shared = [(i * 37 + 11) % 500 + 1 for i in range(96)]
    return {f"req-{i}": shared + [(i * 101 + j * 13) % 500 + 1 for j in range(20 + 9 * i)] for i in range(3)}


def run_vllm_demo(workdir: Path | None = None, *, quiet: bool = False) -> int:
    """Export from vLLM mid-decode, save, and continue in vLLM, flash-attn's layout and transformers."""
    import json
    import os
    import subprocess
    import sys

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

    def say(msg: str) -> None:
        if not quiet:
            print(msg, flush=True)

    with tempfile.TemporaryDirectory() as tmp:
        out = workdir or Path(tmp)
        out.mkdir(parents=True, exist_ok=True)
        t_start = time.perf_counter()
        say("1/6 building a tiny random Llama (4 layers, GQA 8:2, bf16)")
        model_dir = _tiny_llama(out / "tiny-llama")

        say("2/6 running vLLM on the CPU: 3 requests sharing a 96-token prefix")
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt

        from ..adapters.vllm.engine import snapshot

        llm = LLM(model=str(model_dir), skip_tokenizer_init=True, enforce_eager=True, dtype="bfloat16",
                  block_size=DEMO_BLOCK, max_model_len=1024, seed=0)  # fmt: skip
        eng = llm.llm_engine
        sp = SamplingParams(detokenize=False, temperature=0, max_tokens=DEMO_TOKENS, ignore_eos=True)
        prompts = demo_prompts()
        for rid, ids in prompts.items():
            eng.add_request(rid, TokensPrompt(prompt_token_ids=ids), sp)
        for _ in range(DEMO_STEPS):
            eng.step()
        t0 = time.perf_counter()
        snap = snapshot(llm, list(prompts))
        t_export = time.perf_counter() - t0
        outputs: dict[str, list[int]] = {}
        while eng.has_unfinished_requests():
            for o in eng.step():
                if o.finished:
                    outputs[o.request_id] = list(o.outputs[0].token_ids)  # type: ignore[index]
        del llm, eng

        say("3/6 writing .hrry, .hrrs and .safetensors, reading them back")
        sizes, times = {}, {}
        for suffix in (".hrry", ".hrrs", ".safetensors"):
            path = out / f"snapshot{suffix}"
            t0 = time.perf_counter()
            sizes[suffix] = save(snap, path)
            back = load(path)
            times[suffix] = time.perf_counter() - t0
            assert _same(snap, back)
        checks: list[tuple[str, bool]] = [("snapshot validates", validate(out / "snapshot.hrry").ok)]
        stats = snap.sharing()
        checks.append(("prefix sharing kept (3 shared pages)", stats.shared_pages == 3))

        say("4/6 importing into flash-attn's layout (FA2, page size 256) and attending")
        import torch

        from ..adapters.flash_attn import to_flash_attn_all
        from ..adapters.reference import dense_attention, paged_attention

        caches = to_flash_attn_all(snap, page_size=256, flavor="fa2")
        g = torch.Generator().manual_seed(0)
        worst = 0.0
        for layer, cache in enumerate(caches):
            q = torch.randn(snap.num_seqs, 1, 8, 32, generator=g).to(torch.bfloat16)
            got = paged_attention(q, cache.k_cache, cache.v_cache, cache.cache_seqlens, cache.block_table)
            for s in range(snap.num_seqs):
                want = dense_attention(q[s], snap[layer, "key"].to_dense(s), snap[layer, "value"].to_dense(s))
                worst = max(worst, float((got[s].float() - want.float()).abs().max()))
        checks.append((f"FA2 paged attention == dense attention (max err {worst:.1e})", worst < 2e-2))

        say("5/6 continuing in transformers from the vLLM KV")
        from transformers import LlamaForCausalLM

        from ..adapters.transformers import check_continuation

        hf = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()
        done = [len(snap.token_ids[s]) - len(prompts[rid]) for s, rid in enumerate(prompts)]
        # vLLM's kernels and transformers round differently: each of vLLM's tokens must be
        # transformers' argmax or within a few bf16 ulps of it (hurray_vllm.agreement).
        reports = [check_continuation(hf, snap, s, outputs[rid][done[s] :]) for s, rid in enumerate(prompts)]
        agreed = sum(r.exact for r in reports)
        ties = sum(len(r.near_ties) for r in reports)
        steps = sum(r.steps for r in reports)
        checks.append(
            (
                f"transformers continues with vLLM's tokens ({agreed}/{steps} its argmax, {ties} near-ties)",
                all(r.ok for r in reports),
            )
        )

        say("6/6 importing into a second vLLM engine (HurrayConnector) and continuing")
        from ..chunks.store import DirectoryStore, store_snapshot

        chunk = DEMO_BLOCK * 2  # a multiple of both engines' block sizes
        written = store_snapshot(DirectoryStore(out / "store"), snap, chunk)
        cfg = {
            "model": str(model_dir),
            "block_size": 64,  # another block size: the chunks are repaged on load
            "prompts": {rid: list(snap.token_ids[s]) for s, rid in enumerate(prompts)},
            "max_tokens": {rid: DEMO_TOKENS - done[s] for s, rid in enumerate(prompts)},
            "connector": {"hurray_path": str(out / "store"), "hurray_chunk_tokens": chunk},
        }
        (out / "engine2.json").write_text(json.dumps(cfg))
        proc = subprocess.run(
            [sys.executable, "-m", "hurray_vllm.adapters.vllm._generate", str(out / "engine2.json"),
             str(out / "engine2.out")],
            capture_output=True, text=True, timeout=600,
        )  # fmt: skip
        if proc.returncode:
            print(proc.stderr[-3000:], file=sys.stderr)
            checks.append(("second vLLM engine continues with identical tokens", False))
            cached = {}
        else:
            r = json.loads((out / "engine2.out").read_text())
            cached = r["cached"]
            ok = all(r["outputs"][rid] == outputs[rid][done[s] :] for s, rid in enumerate(prompts))
            checks.append(("second vLLM engine (block 64) continues with identical tokens", ok))
            checks.append(("it loaded the KV instead of recomputing it", all(v > 0 for v in cached.values())))

        total = time.perf_counter() - t_start
        if not quiet:
            print()
            layout = snap.source.layout if snap.source else "?"
            print(f"  model: 4 layers, 2 KV heads x 32, bf16; vLLM CPU cache layout {layout}")
            print(f"  snapshot after {DEMO_STEPS} decode steps: {snap.num_seqs} sequences, tokens {snap.seq_lens}")
            pages = f"{stats.logical_pages} logical, {stats.distinct_pages} physical, {stats.shared_pages} shared"
            print(f"  pages: {pages} (saves {stats.saved_bytes} bytes); KV {snap.nbytes / 1024:.0f} KiB")
            print(f"  export from vLLM: {t_export * 1e3:.1f} ms ({snap.nbytes / t_export / 1e6:.0f} MB/s)")
            for suffix in sizes:
                print(f"  {suffix:<13} {sizes[suffix] / 1024:8.0f} KiB, write+read {times[suffix] * 1e3:6.1f} ms")
            print(f"  chunks put in the second engine's store: {written}; tokens it loaded: {cached}")
            print(f"  files in {out}; total {total:.0f} s")
            print()
            width = max(len(c) for c, _ in checks)
            for c, passed in checks:
                print(f"  {c:<{width}}  {'ok' if passed else 'FAILED'}")
        return 0 if all(p for _, p in checks) else 1
