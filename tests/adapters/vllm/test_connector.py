"""HurrayConnector between real vLLM engines (CPU), each in its own process."""

from __future__ import annotations

import shutil
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import servers
from conftest import require
from tiny_models import build_tiny_llama

import hurray_vllm as hv

pytestmark = [pytest.mark.vllm]
CHUNK = 64


def _prompt(seed: int, n: int) -> list[int]:
    return [(i * 37 + seed * 101 + 11) % 500 + 1 for i in range(n)]


SHARED = _prompt(0, 200)
PROMPTS = {
    "p": SHARED,
    "q": SHARED[:130] + _prompt(5, 70),  # shares 2 whole chunks with "p"
    "corrupt": _prompt(1, 150),
    "truncated": _prompt(2, 150),
    "wrong_model": _prompt(3, 150),
    "wrong_layers": _prompt(4, 150),
}


def run_engine(
    tmp: Path,
    name: str,
    block_size: int,
    extra: dict[str, Any] | None,
    prompts: dict[str, list[int]] | None = None,
    max_tokens: int = 8,
    **options: Any,
) -> dict[str, Any]:
    """:func:`servers.run_engine` over this module's prompts unless given others."""
    return servers.run_engine(
        tmp, name, block_size, extra, PROMPTS if prompts is None else prompts, max_tokens, **options
    )


def _store_files(store: Path, prompt: list[int], ns: str) -> list[Path]:
    from hurray_vllm.chunks.store import chunk_keys

    return [store / ns / f"{k}.hrry" for k in chunk_keys(prompt[: (len(prompt) - 1) // CHUNK * CHUNK], CHUNK, ns)]


def _break_store(store: Path) -> None:
    """Damage the chunks of the four refusal prompts, each in its own way."""
    (ns,) = [p.name for p in store.iterdir()]
    for name in ("corrupt", "truncated", "wrong_model", "wrong_layers"):
        first = _store_files(store, PROMPTS[name], ns)[0]
        if name == "corrupt":
            raw = bytearray(first.read_bytes())
            raw[8192 + 100] ^= 0x40  # inside the first page pool: only the digest notices
            first.write_bytes(bytes(raw))
        elif name == "truncated":
            first.write_bytes(first.read_bytes()[:-1000])
        else:
            snap = hv.load(first)
            fp = snap.fingerprint
            assert fp is not None
            other = replace(fp, weights_digest="0" * 32) if name == "wrong_model" else replace(fp, num_layers=3)
            hv.save(replace(snap, fingerprint=other), first)


@pytest.fixture(scope="session")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    require("transformers")
    require("vllm")
    tmp = tmp_path_factory.mktemp("connector")
    build_tiny_llama(tmp / "model")
    store = tmp / "store"
    out = {"plain": run_engine(tmp, "plain", 32, None)}
    out["producer"] = run_engine(tmp, "producer", 32, {"hurray_path": str(store), "hurray_chunk_tokens": CHUNK})
    clean = tmp / "clean-store"
    shutil.copytree(store, clean)
    _break_store(store)
    # Prefix caching off in this one run: "q" then asks the connector for the chunks it shares with "p"
    # (with it on, vLLM serves them itself, and the remembered-chunk path goes untested).
    out["consumer"] = run_engine(
        tmp, "consumer", 32, {"hurray_path": str(store), "hurray_chunk_tokens": CHUNK}, prefix_caching=False
    )
    out["consumer64"] = run_engine(tmp, "consumer64", 64, {"hurray_path": str(clean), "hurray_chunk_tokens": CHUNK})
    # vLLM's prefix cache first holds one 32-token block of "p" (from a short request), so "p" itself
    # then hits locally in the middle of its first 64-token chunk: the connector loads the rest.
    out["midchunk"] = servers.run_engine(
        tmp,
        "midchunk",
        32,
        {"hurray_path": str(clean), "hurray_chunk_tokens": CHUNK},
        {"short": SHARED[:40] + _prompt(7, 10), "p": SHARED},
        8,
        sequential=True,
    )
    out["store"] = store  # type: ignore[assignment]
    return out


def test_a_local_prefix_hit_that_ends_mid_chunk_still_loads_the_rest(runs) -> None:  # type: ignore[no-untyped-def]
    r = runs["midchunk"]
    assert r["outputs"]["p"] == runs["plain"]["outputs"]["p"]
    # 32 tokens from vLLM's own prefix cache, 32 + 128 from the store: vLLM counts both as cached.
    assert r["cached"]["p"] == 192, r["cached"]
    assert r["worker_stats"]["tokens_loaded"] == 160, r["worker_stats"]


def test_consumer_continues_identically_without_recomputing(runs) -> None:  # type: ignore[no-untyped-def]
    for name in ("consumer", "consumer64"):
        r = runs[name]
        for rid in ("p", "q"):
            assert r["outputs"][rid] == runs["plain"]["outputs"][rid], f"{name} {rid}"
        # vLLM's own counter: 3 chunks of 64 of the 200-token prompt came from the store.
        assert r["cached"]["p"] == 192 and r["cached"]["q"] == 192
    # "q" shares 2 chunks with "p": verified once, for "p", then taken from memory.
    assert runs["consumer"]["scheduler_stats"]["chunks_remembered"] >= 2
    assert runs["consumer64"]["worker_stats"]["chunks_loaded"] >= 6


def test_producer_stores_a_shared_prefix_once(runs) -> None:  # type: ignore[no-untyped-def]
    stats = runs["producer"]["worker_stats"]
    sched = runs["producer"]["scheduler_stats"]
    # "p" and "q" share 2 chunks: they are written once.
    per_prompt = {rid: (len(ids) + 7) // CHUNK for rid, ids in PROMPTS.items()}
    assert stats["chunks_saved"] == sum(per_prompt.values()) - 2
    assert sched["chunks_skipped"] + stats["chunks_skipped"] >= 2
    assert runs["producer"]["outputs"] == runs["plain"]["outputs"]


def test_bad_chunks_fall_back_to_recomputation(runs) -> None:  # type: ignore[no-untyped-def]
    r = runs["consumer"]
    for rid in ("corrupt", "truncated", "wrong_model", "wrong_layers"):
        assert r["outputs"][rid] == runs["plain"]["outputs"][rid], rid
        assert r["cached"][rid] == 0, rid
    assert r["scheduler_stats"]["chunks_refused"] == 4
    log = r["log"]
    assert "digest" in log and "another model" in log and "trailer" in log
    # Damaged files were moved aside and written again by this engine's own saves;
    # the other models' chunks were left alone.
    assert r["scheduler_stats"]["chunks_quarantined"] == 2
    from hurray_vllm.chunks.store import verify_chunk

    store = runs["store"]
    (ns,) = [p.name for p in store.iterdir()]
    fp = hv.load(_store_files(store, PROMPTS["p"], ns)[0]).fingerprint
    for name in ("corrupt", "truncated", "wrong_model", "wrong_layers"):
        first = _store_files(store, PROMPTS[name], ns)[0]
        bad = first.with_name(first.name + ".bad")
        assert bad.exists() == (name in ("corrupt", "truncated")), name
        assert first.exists(), name
        if bad.exists():
            verify_chunk(hv.load(first), fp, PROMPTS[name][:CHUNK])  # rewritten whole
