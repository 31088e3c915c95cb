"""HurrayConnector between real vLLM engines (CPU), each in its own process."""

from __future__ import annotations

import shutil
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import servers
from conftest import require
from prefetch import prefetched
from synthetic import save_unchecked
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
    # Its second chunk holds the same 64 tokens as "p"'s second chunk, after another first chunk: the same
    # tokens, other KV. Only the file name (the prefix's hash) tells the two apart.
    "replay": _prompt(6, 64) + SHARED[64:128] + _prompt(8, 22),
    # One whole chunk, then a tail of one 32-token block (96 = 120 // 32 * 32) and 24 tokens after it.
    "tailed": _prompt(9, 120),
}
#: Long prompts for the fault runs (#21): an engine killed while it saves them, then one that loads and saves
#: them while the store is pruned under it.
FAULT_PROMPTS = {f"f{i}": _prompt(20 + i, 900) for i in range(8)}
#: The refusals a keyed consumer meets (test_keyed_engines_load_only_chunks_signed_for_their_prefix).
KEYED_PROMPTS = ("p", "q", "corrupt", "truncated", "wrong_model", "replay")


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
            save_unchecked(replace(snap, fingerprint=other), first)  # hv.save refuses layers the model lacks


@pytest.fixture(scope="session")
@prefetched
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    require("transformers")
    require("vllm")
    tmp = tmp_path_factory.mktemp("connector")
    build_tiny_llama(tmp / "model")
    store = tmp / "store"
    extra = {"hurray_path": str(store), "hurray_chunk_tokens": CHUNK}
    # Engines that share no store run side by side (servers.side_by_side): each consumer reads a copy.
    out = servers.side_by_side(
        {
            "plain": lambda: run_engine(tmp, "plain", 32, None, {**PROMPTS, **FAULT_PROMPTS}),
            "producer": lambda: run_engine(tmp, "producer", 32, extra),
        }
    )
    clean = tmp / "clean-store"
    shutil.copytree(store, clean)
    _break_store(store)
    midchunk_store = tmp / "midchunk-store"
    shutil.copytree(clean, midchunk_store)
    keyed = tmp / "keyed-store"
    shutil.copytree(clean, keyed)
    key_file = tmp / "fleet.key"
    key_file.write_bytes(b"fleet key of the connector test, 32+ bytes\n")
    key_file.chmod(0o600)
    from hurray_vllm.chunks import load_keys

    _sign_and_forge(keyed, load_keys(key_file))
    out.update(
        servers.side_by_side(
            {
                "faults": lambda: _fault_runs(tmp),  # two engines one after the other: first, to even the load
                # Prefix caching off in this one run: "q" then asks the connector for the chunks it shares
                # with "p" (with it on, vLLM serves them itself, and the remembered-chunk path goes untested).
                "consumer": lambda: run_engine(tmp, "consumer", 32, extra, prefix_caching=False),
                "consumer64": lambda: run_engine(
                    tmp, "consumer64", 64, {"hurray_path": str(clean), "hurray_chunk_tokens": CHUNK}
                ),
                # vLLM's prefix cache first holds one 32-token block of "p" (from a short request), so "p"
                # itself then hits locally in the middle of its first 64-token chunk: the connector loads
                # the rest.
                "midchunk": lambda: servers.run_engine(
                    tmp,
                    "midchunk",
                    32,
                    {"hurray_path": str(midchunk_store), "hurray_chunk_tokens": CHUNK},
                    {"short": SHARED[:40] + _prompt(7, 10), "p": SHARED},
                    8,
                    sequential=True,
                ),
                "keyed": lambda: run_engine(
                    tmp,
                    "keyed",
                    32,
                    {"hurray_path": str(keyed), "hurray_chunk_tokens": CHUNK, "hurray_key_file": str(key_file)},
                    {rid: PROMPTS[rid] for rid in KEYED_PROMPTS},
                ),
            }
        )
    )
    out.update(out.pop("faults"))
    out["store"] = store  # type: ignore[assignment]
    out["keyed_store"], out["key_file"] = keyed, key_file  # type: ignore[assignment]
    return out


def _fault_runs(tmp: Path) -> dict[str, Any]:
    """An engine SIGKILLed while it saves; then one that loads and saves on that store while it is pruned."""
    import threading

    from hurray_vllm.chunks import DirectoryStore, fsck

    store = tmp / "fault-store"
    store.mkdir()
    extra = {"hurray_path": str(store), "hurray_chunk_tokens": CHUNK}
    total = len(FAULT_PROMPTS) * (900 - 1) // CHUNK
    # Killed once its first chunk file is complete: the others are being exported and written then.
    killed = servers.kill_engine_when(tmp, "killed", 32, extra, FAULT_PROMPTS, lambda: any(store.rglob("*.hrry")))
    after_kill = fsck(DirectoryStore(store))
    saved = len(list(store.rglob("*.hrry")))
    stop = threading.Event()
    pruned: list[int] = []

    def prune() -> None:  # what an operator's cron job would do, at the worst moments, over and over
        while not stop.is_set():
            size = sum(p.stat().st_size for p in store.rglob("*.hrry") if p.exists())
            pruned.append(DirectoryStore(store).prune(size // 2).chunks_removed)
            time.sleep(0.01)

    pruner = threading.Thread(target=prune, daemon=True)
    pruner.start()
    try:
        loaded = run_engine(tmp, "pruned", 32, extra, FAULT_PROMPTS)
    finally:
        stop.set()
        pruner.join(timeout=30)
    return {
        "killed": {"killed": killed, "saved": saved, "total": total, "fsck": after_kill},
        "pruned": {**loaded, "pruned_chunks": sum(pruned), "fsck": fsck(DirectoryStore(store))},
    }


def _sign_and_forge(store: Path, keys: Any) -> None:
    """Sign every chunk of ``store`` as a keyed producer would; then forge four, each as an attacker could.

    * "corrupt": other KV with a correct checksum, unsigned (whoever can write the directory can do that);
    * "truncated": a valid chunk signed with another fleet's key;
    * "wrong_model": other KV, checksum recomputed, its old MAC kept;
    * "replay": "p"'s second chunk, validly signed for "p", copied under "replay"'s second key (same tokens).
    """
    from hurray_vllm.chunks.digest import DIGEST_KEY, MAC_KEY, chunk_digest
    from hurray_vllm.chunks.signing import FleetKeys, sign_chunk

    (ns,) = [p.name for p in store.iterdir()]
    for path in (store / ns).glob("*.hrry"):
        hv.save(sign_chunk(hv.load(path), keys, ns, path.stem), path)

    def other_kv(snap: hv.KVSnapshot) -> hv.KVSnapshot:
        pool = snap.keys[0].page_pool.clone()
        pool += 1.0  # every key of layer 0 moved: attended, this changes the output
        out = replace(snap, keys=[replace(snap.keys[0], page_pool=pool), *snap.keys[1:]])
        return replace(out, extra={**out.extra, DIGEST_KEY: chunk_digest(out)})

    first = {name: _store_files(store, PROMPTS[name], ns)[0] for name in ("corrupt", "truncated", "wrong_model")}
    forged = other_kv(hv.load(first["corrupt"]))
    hv.save(replace(forged, extra={k: v for k, v in forged.extra.items() if k != MAC_KEY}), first["corrupt"])
    snap = hv.load(first["truncated"])
    hv.save(sign_chunk(snap, FleetKeys.from_secrets(b"another fleet's key" + b"." * 16), ns, first["truncated"].stem),
            first["truncated"])  # fmt: skip
    hv.save(other_kv(hv.load(first["wrong_model"])), first["wrong_model"])
    shutil.copyfile(_store_files(store, PROMPTS["p"], ns)[1], _store_files(store, PROMPTS["replay"], ns)[1])


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


def test_a_prompt_tail_loads_every_whole_block_of_it(runs) -> None:  # type: ignore[no-untyped-def]
    """hurray_tails: the producer saved "tailed"'s whole blocks after its chunk; a consumer of its block size
    loads them too and computes only the last 24 tokens; one with larger blocks cannot use a 32-token tail."""
    assert runs["producer"]["worker_stats"]["tails_saved"] >= 1
    for name in ("consumer", "consumer64"):
        assert runs[name]["outputs"]["tailed"] == runs["plain"]["outputs"]["tailed"], name
    assert runs["consumer"]["cached"]["tailed"] == 96, runs["consumer"]["cached"]
    assert runs["consumer"]["worker_stats"]["tails_loaded"] >= 1
    assert runs["consumer64"]["cached"]["tailed"] == 64, runs["consumer64"]["cached"]


def test_producer_stores_a_shared_prefix_once(runs) -> None:  # type: ignore[no-untyped-def]
    stats = runs["producer"]["worker_stats"]
    sched = runs["producer"]["scheduler_stats"]
    # "p" and "q" share 2 chunks: they are written once.
    per_prompt = {rid: (len(ids) + 7) // CHUNK for rid, ids in PROMPTS.items()}
    assert stats["chunks_saved"] == sum(per_prompt.values()) - 2
    assert sched["chunks_skipped"] + stats["chunks_skipped"] >= 2
    assert runs["producer"]["outputs"] == {rid: runs["plain"]["outputs"][rid] for rid in PROMPTS}


def test_keyed_engines_load_only_chunks_signed_for_their_prefix(runs) -> None:  # type: ignore[no-untyped-def]
    """#21: forged, foreign-key and replayed chunks are refused and recomputed; signed ones load as before."""
    r = runs["keyed"]
    for rid in KEYED_PROMPTS:
        assert r["outputs"][rid] == runs["plain"]["outputs"][rid], rid
    # "p" and "q": signed by the fleet key (as a keyed producer signs) and loaded whole; "replay" its first chunk.
    want = {"p": 192, "q": 192, "corrupt": 0, "truncated": 0, "wrong_model": 0, "replay": 64}
    assert {rid: r["cached"][rid] for rid in KEYED_PROMPTS} == want, r["cached"]
    stats = r["scheduler_stats"]
    assert (stats["chunks_unsigned"], stats["chunks_other_key"], stats["chunks_bad_mac"]) == (1, 1, 2), stats
    # The wrong MACs (forged or replayed) are moved aside and written again, signed; the unsigned and the
    # other fleet's chunk stay where they are (not damage: their owners may load them).
    assert stats["chunks_quarantined"] == 2
    from hurray_vllm.chunks import check_data, load_keys

    store, keys = runs["keyed_store"], load_keys(runs["key_file"])
    (ns,) = [p.name for p in store.iterdir()]
    for rid, index in (("wrong_model", 0), ("replay", 1)):
        path = _store_files(store, PROMPTS[rid], ns)[index]
        assert path.with_name(path.name + ".bad").exists(), rid
        check_data(hv.load(path), keys, ns, path.stem)  # rewritten by the keyed engine, signed for its name
    for rid in ("corrupt", "truncated"):
        path = _store_files(store, PROMPTS[rid], ns)[0]
        assert path.exists() and not path.with_name(path.name + ".bad").exists(), rid


def test_an_engine_killed_while_it_saves_leaves_only_whole_chunks(runs) -> None:  # type: ignore[no-untyped-def]
    """#21 fault injection: SIGKILL mid-save; the store is consistent (fsck) and the next engine is correct."""
    k = runs["killed"]
    assert k["killed"] and 0 < k["saved"] < k["total"], k
    assert k["fsck"].clean and k["fsck"].good == k["saved"], k["fsck"]


def test_pruning_while_an_engine_loads_and_saves_never_costs_a_wrong_token(runs) -> None:  # type: ignore[no-untyped-def]
    r = runs["pruned"]
    for rid in FAULT_PROMPTS:
        assert r["outputs"][rid] == runs["plain"]["outputs"][rid], rid
    assert r["pruned_chunks"] > 0 and r["fsck"].clean, (r["pruned_chunks"], r["fsck"])


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
