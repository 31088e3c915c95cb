"""``hurray-vllm demo``: the format round trip on the specification's own example, and the vLLM demo.

:func:`run_format_demo` (``--format-only``, no vLLM): the spec's example
(layer 3, page_size 4, 5 pages, 2 heads x 8, float16, sequences of 6 and 3
tokens sharing page 0) is extended to a 4-layer snapshot, written as a
``.hrry`` file and as a stream, read back, checked element by element,
validated, and converted.

:func:`run_vllm_demo` (the default): a tiny random Llama runs in vLLM on the
CPU with requests sharing a prefix, is snapshotted mid-decode, written as
``.hrry``, ``.hrrs`` and ``.safetensors``, and continued in flash-attn's
layout, in transformers and in a second vLLM engine that loads the KV
through HurrayConnector.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..containers.check import validate
from ..containers.io import load, save
from ..kv.paged import BlockPagedTensor
from ..kv.snapshot import KVSnapshot, ModelFingerprint, SnapshotSource
from ..wire.descriptor import encode_descriptor

__all__ = ["run_format_demo", "run_vllm_demo", "spec_example_snapshot", "demo_prompts"]


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


def run_format_demo(workdir: Path | None = None, *, quiet: bool = False, keep: bool = False) -> int:
    """The format round trip on the spec's example (no engine); returns the exit code (0: every check passed).

    Args:
        workdir: Where to write the files (kept); default a temporary directory.
        quiet: Print nothing on stdout (a kept temporary directory is named on stderr).
        keep: Keep the temporary directory (its path is printed).

    Example:
        >>> run_format_demo(quiet=True)
        0
    """
    with _work_dir(workdir, keep, quiet) as out:
        snap = spec_example_snapshot()
        desc = encode_descriptor(snap[3, "key"].descriptor())
        checks = _Checks()
        checks.add("layer 3 key descriptor is the spec's 133 bytes", len(desc) == 133)
        # Element lookup by the spec formula == to_dense.
        k = snap[3, "key"]
        ok = all(
            torch.equal(k.lookup(s, t, h, d), k.to_dense(s)[t, h, d])
            for s in range(2)
            for t in range(int(k.seq_lens[s]))  # type: ignore[index]
            for h in range(2)
            for d in range(8)
        )
        checks.add("element lookup formula matches to_dense", ok)
        written = []
        for suffix in (".hrry", ".hrrs"):
            path = out / f"spec-example{suffix}"
            t0 = time.perf_counter()
            size = save(snap, path)
            back = load(path)
            dt = time.perf_counter() - t0
            written.append(path)
            checks.add(f"{suffix} round trip is exact ({size} bytes, {dt * 1e3:.1f} ms)", _same(snap, back))
            checks.add(f"{suffix} validates", validate(path).ok)
        stats = snap.sharing()
        if not quiet:
            print("hurray-vllm demo: the block-paged spec example, 4 layers")
            print(f"  layer 3 key descriptor ({len(desc)} bytes): {desc.hex()}")
            print(
                f"  sequences: {snap.seq_lens} tokens; logical pages {stats.logical_pages}, "
                f"physical {stats.distinct_pages}, shared {stats.shared_pages}"
            )
            print(_where(out, written, kept=workdir is not None or keep))
            print()
            checks.print()
        return checks.exit_code()


class _Checks:
    """The demo's named pass/fail checks, printed as a table at the end."""

    def __init__(self) -> None:
        self.items: list[tuple[str, bool]] = []
        #: What a failed check said (an engine's exit and the end of its log), for stderr.
        self.failures: list[str] = []

    def add(self, label: str, ok: bool) -> None:
        self.items.append((label, bool(ok)))

    def fail(self, label: str, why: str) -> None:
        """A failed check, and what it said (printed on stderr by :meth:`print_failures`, also with ``-q``)."""
        self.add(label, False)
        self.failures.append(why)

    def print_failures(self) -> None:
        """What the failed checks said, on stderr: ``-q`` silences stdout, not a failure's reason."""
        for why in self.failures:
            print(why, file=sys.stderr, flush=True)

    def exit_code(self) -> int:
        return 0 if all(ok for _, ok in self.items) else 1

    def print(self) -> None:
        width = max(len(c) for c, _ in self.items)
        for c, ok in self.items:
            print(f"  {c:<{width}}  {'ok' if ok else 'FAILED'}")


@contextmanager
def _work_dir(workdir: Path | None, keep: bool, quiet: bool = False) -> Iterator[Path]:
    """``workdir`` (created, kept), or a fresh temporary directory removed afterwards unless ``keep``.

    A kept temporary directory is named on stderr when the summary that names it is not printed (``quiet``,
    or a step raised): its path is known nowhere else, and after a failure its files (``demo.log``) are what
    --keep was asked for.
    """
    if workdir is not None:
        workdir.mkdir(parents=True, exist_ok=True)
        yield workdir
        return
    tmp = Path(tempfile.mkdtemp(prefix="hurray-vllm-demo-"))
    summarized = False
    try:
        yield tmp
        summarized = not quiet
    finally:
        if not keep:
            shutil.rmtree(tmp, ignore_errors=True)
        elif not summarized:
            print(f"hurray-vllm demo: files kept in {tmp}", file=sys.stderr, flush=True)


def _where(out: Path, files: list[Path], *, kept: bool) -> str:
    names = ", ".join(f.name for f in files)
    if kept:
        return f"  files: {names} in {out}"
    return f"  files: {names} in {out} (removed on exit; --keep or --workdir DIR keeps them)"


# ── the main job: vLLM -> Hurray -> vLLM, flash-attn and transformers ────────


def _tiny_llama(path: Path) -> Path:
    """The demo's model at ``path``: reused when a --workdir holds a whole one, else built.

    Built beside ``path`` and renamed into place: transformers writes ``config.json`` before the weights, so
    a build interrupted in place would leave a directory taken for a model.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    if (path / "config.json").exists() and any(path.glob("*.safetensors")):
        return path
    if path.exists():  # an older version's interrupted build: no weights
        shutil.rmtree(path)
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
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))
    try:
        LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(tmp)
        tmp.rename(path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path


DEMO_BLOCK = 32
DEMO_STEPS = 6  # decode steps before the snapshot
DEMO_TOKENS = 16  # tokens generated in total
SECOND_ENGINE_TIMEOUT = 600.0  # seconds the second engine's process may take


def demo_prompts() -> dict[str, list[int]]:
    """Three requests sharing a 96-token system prompt (3 blocks of 32)."""
    shared = [(i * 37 + 11) % 500 + 1 for i in range(96)]
    return {f"req-{i}": shared + [(i * 101 + j * 13) % 500 + 1 for j in range(20 + 9 * i)] for i in range(3)}


@dataclass
class _FirstRun:
    """What the first vLLM engine produced: the mid-decode snapshot and every request's full output."""

    snap: KVSnapshot
    prompts: dict[str, list[int]]
    outputs: dict[str, list[int]]  # all DEMO_TOKENS generated tokens, by request id
    export_s: float

    def done(self, s: int) -> int:
        """How many tokens sequence ``s`` had generated when it was snapshotted."""
        rid = list(self.prompts)[s]
        return len(self.snap.token_ids[s]) - len(self.prompts[rid])

    def rest(self, s: int) -> list[int]:
        """The tokens vLLM generated for sequence ``s`` after the snapshot: what every importer must continue with."""
        return self.outputs[list(self.prompts)[s]][self.done(s) :]


def run_vllm_demo(
    workdir: Path | None = None, *, quiet: bool = False, verbose: bool = False, keep: bool = False
) -> int:
    """Export from vLLM mid-decode, save, and continue in vLLM, flash-attn's layout and transformers.

    Returns the exit code: 0 when every check passed.

    Args:
        workdir: Where to write the model, the files and the chunk store (kept); default a temporary directory.
        quiet: Print nothing on stdout (a kept temporary directory is named on stderr).
        verbose: Show vLLM's, transformers' and torch's logs (otherwise they go to ``demo.log`` in the work
            directory, whose end is printed if a step fails).
        keep: Keep the temporary directory (its path is printed).
    """
    import importlib.util

    for package in ("vllm", "transformers"):  # before any work: a missing one is said at once, not after a build
        if importlib.util.find_spec(package) is None:
            raise ModuleNotFoundError(f"No module named {package!r}", name=package)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")  # a demo reports nothing to vLLM's usage statistics
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "INFO" if verbose else "ERROR")

    def say(msg: str) -> None:
        if not quiet:
            print(msg, flush=True)

    with _work_dir(workdir, keep, quiet) as out:
        t_start = time.perf_counter()
        checks = _Checks()
        say("1/7 building the native kernels (once per machine; cached afterwards)")
        native_s, native_note = _native_kernels()
        with _engine_logs(out / "demo.log", verbose):
            say("2/7 building a tiny random Llama (4 layers, GQA 8:2, bf16)")
            model_dir = _tiny_llama(out / "tiny-llama")
            say("3/7 running vLLM on the CPU: 3 requests sharing a 96-token prefix, snapshot after 6 steps")
            run = _first_engine(model_dir)
            say("4/7 writing .hrry, .hrrs and .safetensors, reading them back")
            files = _files(run.snap, out, checks)
            say("5/7 importing into flash-attn's layout (FA2, page size 256) and attending")
            _flash_attn(run.snap, checks)
            say("6/7 continuing in transformers from the vLLM KV")
            _transformers(model_dir, run, checks)
            say("7/7 importing into a second vLLM engine (HurrayConnector, block 64) and continuing")
            written, cached = _second_engine(model_dir, run, out, checks, verbose)
        checks.print_failures()  # after the engine logs: inside, stderr goes into demo.log
        if not quiet:
            snap, stats = run.snap, run.snap.sharing()
            print()
            layout = snap.source.layout if snap.source else "?"
            print(f"  model: 4 layers, 2 KV heads x 32, bf16; vLLM CPU cache layout {layout}")
            print(f"  snapshot after {DEMO_STEPS} decode steps: {snap.num_seqs} sequences, tokens {snap.seq_lens}")
            pages = f"{stats.logical_pages} logical, {stats.distinct_pages} physical, {stats.shared_pages} shared"
            print(f"  pages: {pages} (saves {stats.saved_bytes} bytes); KV {snap.nbytes / 1024:.0f} KiB")
            print(f"  native kernels: {native_note} in {native_s * 1e3:.0f} ms (not part of the export)")
            rate = snap.nbytes / run.export_s / 1e6
            print(f"  export from vLLM: {run.export_s * 1e3:.1f} ms ({rate:.0f} MB/s)")
            for path, (size, dt) in files.items():
                print(f"  {path.suffix:<13} {size / 1024:8.0f} KiB, write+read {dt * 1e3:6.1f} ms")
            print(f"  chunks put in the second engine's store: {written}; tokens it loaded: {cached}")
            print(_where(out, [*files, out / "store", out / "demo.log"], kept=workdir is not None or keep))
            print(f"  total {time.perf_counter() - t_start:.0f} s")
            print()
            checks.print()
        return checks.exit_code()


def _native_kernels() -> tuple[float, str]:
    """Build (or load the cached) native kernels now, so that their build is not timed as the export."""
    from .. import native

    t0 = time.perf_counter()
    lib = native.library()
    dt = time.perf_counter() - t0
    return dt, "ready" if lib is not None else (native.unavailable_reason() or "unavailable")


@contextmanager
def _engine_logs(log: Path, verbose: bool) -> Iterator[None]:
    """Send what the engines write to stderr (C++ warnings, progress bars, Python warnings) to ``log``.

    Redirects the file descriptor, not just ``sys.stderr``: vLLM's and
    torch's native code write to it directly. On an exception the log's end
    is printed, so a failure is never silent.
    """
    if verbose:
        yield
        return
    sys.stderr.flush()
    saved = os.dup(2)
    with open(log, "ab") as f:
        os.dup2(f.fileno(), 2)
        try:
            yield
        except BaseException:
            sys.stderr.flush()
            os.dup2(saved, 2)
            tail = log.read_bytes()[-4000:].decode(errors="replace")
            print(f"--- the end of {log} ---\n{tail}", file=sys.stderr)
            raise
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)


def _first_engine(model_dir: Path) -> _FirstRun:
    """Run vLLM on the demo prompts, snapshot them mid-decode, and let them finish."""
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
    export_s = time.perf_counter() - t0
    outputs: dict[str, list[int]] = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                outputs[o.request_id] = list(o.outputs[0].token_ids)  # type: ignore[index]
    return _FirstRun(snap, prompts, outputs, export_s)


def _files(snap: KVSnapshot, out: Path, checks: _Checks) -> dict[Path, tuple[int, float]]:
    """Save and load the snapshot in every format; ``{path: (bytes, write+read seconds)}``."""
    files: dict[Path, tuple[int, float]] = {}
    exact = True
    for suffix in (".hrry", ".hrrs", ".safetensors"):
        path = out / f"snapshot{suffix}"
        t0 = time.perf_counter()
        size = save(snap, path)
        back = load(path)
        files[path] = (size, time.perf_counter() - t0)
        exact = exact and _same(snap, back)
    checks.add("every format reads back exactly", exact)
    checks.add("snapshot validates", validate(out / "snapshot.hrry").ok)
    checks.add("prefix sharing kept (3 shared pages)", snap.sharing().shared_pages == 3)
    return files


def _flash_attn(snap: KVSnapshot, checks: _Checks) -> None:
    """Attend over the FA2 page pools with the reference kernel and compare with dense attention."""
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
    checks.add(f"FA2 paged attention == dense attention (max err {worst:.1e})", worst < 2e-2)


def _transformers(model_dir: Path, run: _FirstRun, checks: _Checks) -> None:
    """Continue every sequence in transformers from the imported KV; vLLM's tokens must agree."""
    from transformers import LlamaForCausalLM

    from ..adapters.transformers import check_continuation

    hf = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()
    # vLLM's kernels and transformers round differently: each of vLLM's tokens must be
    # transformers' argmax or within a few bf16 ulps of it (hurray_vllm.agreement).
    reports = [check_continuation(hf, run.snap, s, run.rest(s)) for s in range(run.snap.num_seqs)]
    agreed = sum(r.exact for r in reports)
    ties = sum(len(r.near_ties) for r in reports)
    steps = sum(r.steps for r in reports)
    label = f"transformers continues with vLLM's tokens ({agreed}/{steps} its argmax, {ties} near-ties)"
    checks.add(label, all(r.ok for r in reports))


def _second_engine(
    model_dir: Path, run: _FirstRun, out: Path, checks: _Checks, verbose: bool
) -> tuple[int, dict[str, Any]]:
    """Put the snapshot's chunks in a store and continue in a second engine (its own process, block 64)."""
    import json
    import subprocess

    from ..chunks.store import DirectoryStore, store_snapshot

    snap, rids = run.snap, list(run.prompts)
    chunk = DEMO_BLOCK * 2  # a multiple of both engines' block sizes
    written = store_snapshot(DirectoryStore(out / "store"), snap, chunk)
    cfg = {
        "model": str(model_dir),
        "block_size": 64,  # another block size: the chunks are repaged on load
        "prompts": {rid: list(snap.token_ids[s]) for s, rid in enumerate(rids)},
        "max_tokens": {rid: DEMO_TOKENS - run.done(s) for s, rid in enumerate(rids)},
        "connector": {"hurray_path": str(out / "store"), "hurray_chunk_tokens": chunk},
    }
    (out / "engine2.json").write_text(json.dumps(cfg))
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "hurray_vllm.adapters.vllm._generate", str(out / "engine2.json"),
             str(out / "engine2.out")],
            stdout=None if verbose else subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
            timeout=SECOND_ENGINE_TIMEOUT,
        )  # fmt: skip
    except subprocess.TimeoutExpired as exc:  # killed: a failed check, with what it said, not a crash
        said = exc.stderr.decode(errors="replace") if isinstance(exc.stderr, bytes) else exc.stderr or ""
        sys.stderr.write(said)  # into demo.log unless --verbose
        checks.fail(
            "second vLLM engine continues with identical tokens",
            f"the second engine did not finish within {exc.timeout:.0f} s and was stopped:\n{said[-3000:]}",
        )
        return written, {}
    sys.stderr.write(proc.stderr)  # into demo.log unless --verbose
    if proc.returncode:
        checks.fail(
            "second vLLM engine continues with identical tokens",
            f"the second engine failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}",
        )
        return written, {}
    r = json.loads((out / "engine2.out").read_text())
    ok = all(r["outputs"][rid] == run.rest(s) for s, rid in enumerate(rids))
    checks.add("second vLLM engine (block 64) continues with identical tokens", ok)
    checks.add("it loaded the KV instead of recomputing it", all(v > 0 for v in r["cached"].values()))
    return written, dict(r["cached"])
