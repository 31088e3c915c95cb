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

from .api import load, save
from .descriptor import encode_descriptor
from .paged import BlockPagedTensor
from .snapshot import KVSnapshot, ModelFingerprint, SnapshotSource
from .validate import validate


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
