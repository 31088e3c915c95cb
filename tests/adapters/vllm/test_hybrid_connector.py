"""HurrayConnector on a sliding-window hybrid (Gemma 3 style) between real vLLM engines, each in its own process.

The connector implements ``SupportsHMA``, so vLLM keeps its hybrid KV cache
manager: three sliding-window groups (window 64) and one full-attention
group. Chunks (128 tokens) carry every group; a sliding layer keeps only the
blocks a resume at the chunk's end or later attends.
"""

from __future__ import annotations

import shutil
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import servers
from conftest import require
from prefetch import prefetched
from tiny_models import build_tiny_gemma3

import hurray_vllm as hv
from hurray_vllm.chunks import chunk_keys
from hurray_vllm.chunks.digest import chunk_digest
from hurray_vllm.chunks.store import DIGEST_KEY

pytestmark = [pytest.mark.vllm]
BLOCK, CHUNK, WINDOW = 32, 128, 64


def _prompt(seed: int, n: int) -> list[int]:
    return [(i * 37 + seed * 101 + 11) % 500 + 1 for i in range(n)]


SHARED = _prompt(2, 300)  # a prompt whose greedy tokens vary with this tiny model
# "e" shares nothing: the test drops a sliding-window part of its second chunk before the consumer runs.
PROMPTS = {"p": SHARED, "q": [*SHARED[:200], *_prompt(5, 60)], "short": _prompt(2, 40), "e": _prompt(11, 290)}
MOVED, MOVED_AFTER = _prompt(9, 250), 8


@pytest.fixture(scope="session")
@prefetched
def hybrid_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    require("transformers")
    require("vllm")
    tmp = tmp_path_factory.mktemp("hybrid-connector")
    build_tiny_gemma3(tmp / "model", window=WINDOW)
    store = tmp / "store"
    extra = {"hurray_path": str(store), "hurray_chunk_tokens": CHUNK}
    runs: dict[str, Any] = {"store": store}
    last = {"hurray_path": str(tmp / "store-last"), "hurray_chunk_tokens": CHUNK, "hurray_window_chunks": "last"}
    runs["last_store"] = tmp / "store-last"

    def last_policy() -> dict[str, Any]:
        # "p" keeps no window in its first chunk; "r", whose prompt ends just past it, stores it again with one.
        producer = servers.run_engine(
            tmp, "last-producer", BLOCK, last, {"p": SHARED, "r": SHARED[:140]}, 10, sequential=True
        )
        return {
            "last_producer": producer,
            "last_consumer": servers.run_engine(tmp, "last-consumer", BLOCK, last, PROMPTS, 10),
        }

    def decode() -> dict[str, Any]:
        # A migration mid-decode: "m" (250 tokens) completes its second chunk in its 6th decode step; moved after
        # MOVED_AFTER tokens, the destination's prompt ends past that chunk, whose windows a decode step saved.
        extra = {"hurray_path": str(tmp / "store-decode"), "hurray_chunk_tokens": CHUNK}
        producer = servers.run_engine(tmp, "decode-producer", BLOCK, extra, {"m": MOVED}, 20)
        moved = [*MOVED, *producer["outputs"]["m"][:MOVED_AFTER]]
        consumer = servers.run_engine(tmp, "decode-consumer", BLOCK, extra, {"m_moved": moved}, 12)
        return {"decode_producer": producer, "decode_consumer": consumer}

    # Runs that share no store go side by side (two-engine chains first, to even the load).
    both = servers.side_by_side(
        {
            "last": last_policy,
            "decode": decode,
            "plain": lambda: servers.run_engine(tmp, "plain", BLOCK, None, PROMPTS, 10),
            "producer": lambda: servers.run_engine(tmp, "producer", BLOCK, extra, PROMPTS, 10),
        }
    )
    runs |= both.pop("last") | both.pop("decode") | both
    clean = tmp / "clean-store"
    shutil.copytree(store, clean)
    runs["edited_key"] = _drop_a_sliding_part(store)
    runs |= servers.side_by_side(
        {
            "consumer": lambda: servers.run_engine(tmp, "consumer", BLOCK, extra, PROMPTS, 10),
            # vLLM's hybrid prefix cache first holds the 32-token block "short2" shares with "p" (in every group:
            # the window reaches back over it), so "p" hits locally inside its first chunk; the connector loads
            # the rest.
            "midchunk": lambda: servers.run_engine(
                tmp,
                "midchunk",
                BLOCK,
                {**extra, "hurray_path": str(clean)},
                {"short2": [*SHARED[:40], *_prompt(7, 10)], "p": SHARED},
                10,
                sequential=True,
            ),
        }
    )
    return runs


def _drop_a_sliding_part(store: Path) -> str:
    """Rewrite "e"'s second chunk as if layer 0's part had been lost (validly signed: only the window check sees it)."""
    (ns,) = [p.name for p in store.iterdir()]
    key = chunk_keys(PROMPTS["e"][: 2 * CHUNK], CHUNK, ns)[1]
    path = store / ns / f"{key}.hrry"
    snap = hv.load(path)
    assert snap.windows is not None
    starts = list(snap.windows.kv_start)
    starts[0] = (CHUNK,)  # layer 0 holds none of its tokens now
    snap = replace(snap, windows=hv.SlidingWindows(snap.windows.sizes, tuple(starts)))
    hv.save(replace(snap, extra={**snap.extra, DIGEST_KEY: chunk_digest(snap)}), path)
    return key


def test_vllm_keeps_its_hybrid_kv_cache_manager_with_the_connector(hybrid_runs: dict[str, Any]) -> None:
    assert hybrid_runs["producer"]["hybrid_kv_cache_manager"] is True
    assert hybrid_runs["consumer"]["hybrid_kv_cache_manager"] is True
    log = hybrid_runs["producer"]["log"]
    assert "Turning off hybrid kv cache manager" not in log
    assert "does not support it" not in log


def test_chunks_carry_every_group_and_sliding_layers_only_their_window(hybrid_runs: dict[str, Any]) -> None:
    store: Path = hybrid_runs["store"]
    (ns,) = [p.name for p in store.iterdir()]
    files = sorted((store / ns).glob("*.hrry"))
    assert len(files) == 5  # "p": 2 chunks, "q": its own second chunk ("q" and "p" share the first), "e": 2
    chunks = [hv.load(p) for p in files if p.name != f"{hybrid_runs['edited_key']}.hrry"]
    for chunk in chunks:
        assert chunk.num_layers == 4 and chunk.windows is not None
        assert chunk.windows.sizes == (WINDOW, WINDOW, WINDOW, None)
        # A resume at the chunk's end attends from 128 - 64 + 1 = 65 on: blocks 0 and 1 are not kept.
        assert [row[0] for row in chunk.windows.kv_start] == [64, 64, 64, 0]
        full, sliding = chunk[3, "key"].num_pages, chunk[0, "key"].num_pages
        assert (full, sliding) == (4, 3)  # 2 held pages and one zero page
        assert chunk.validate().ok


def test_consumer_continues_identically_from_every_group(hybrid_runs: dict[str, Any]) -> None:
    plain, consumer = hybrid_runs["plain"], hybrid_runs["consumer"]
    assert consumer["outputs"] == plain["outputs"]
    # Whole chunks before each prompt's last token, counted by vLLM as cached ("e": see the next test).
    assert consumer["cached"]["p"] == 256 and consumer["cached"]["q"] == 256 and consumer["cached"]["short"] == 0
    assert consumer["worker_stats"]["chunks_loaded"] >= 3
    assert len(set(plain["outputs"]["p"])) > 3


def test_a_chunk_missing_a_groups_part_is_not_loaded(hybrid_runs: dict[str, Any]) -> None:
    """Its sliding-window part is gone: a resume at its end would lack the window, so only the chunk before loads."""
    consumer, plain = hybrid_runs["consumer"], hybrid_runs["plain"]
    assert consumer["cached"]["e"] == CHUNK  # the first chunk only
    assert consumer["outputs"]["e"] == plain["outputs"]["e"]


def test_the_last_policy_keeps_one_window_and_the_prompt_end_resumable(hybrid_runs: dict[str, Any]) -> None:
    """``hurray_window_chunks=last``: "p"'s first chunk keeps no sliding block; "p" still resumes at its end.

    "r" (140 tokens) then ends just past that chunk: its copy, holding the window a resume at 128 attends,
    replaces "p"'s. "q" shares only that chunk with "p", and resumes at its end.
    """
    store: Path = hybrid_runs["last_store"]
    (ns,) = [p.name for p in store.iterdir()]
    first, second = (hv.load(store / ns / f"{k}.hrry") for k in chunk_keys(SHARED[: 2 * CHUNK], CHUNK, ns))
    assert [row[0] for row in second.windows.kv_start] == [64, 64, 64, 0]
    # "p"'s copy held none (a resume at 256 attends from 193 on); "r"'s holds from block 2 (for 65 on).
    assert [row[0] for row in first.windows.kv_start] == [64, 64, 64, 0]
    assert hybrid_runs["last_producer"]["worker_stats"]["chunks_saved"] == 3  # "p" 2, then "r" the first again
    consumer, plain = hybrid_runs["last_consumer"], hybrid_runs["plain"]
    assert consumer["cached"]["p"] == 256 and consumer["cached"]["q"] == CHUNK
    assert consumer["outputs"] == plain["outputs"]


def test_a_request_moved_mid_decode_loads_the_chunk_a_decode_step_completed(hybrid_runs: dict[str, Any]) -> None:
    """Migration: the chunk ending at 256 was saved in a decode step, with the windows a resume there attends."""
    producer, consumer = hybrid_runs["decode_producer"], hybrid_runs["decode_consumer"]
    assert consumer["cached"]["m_moved"] == 2 * CHUNK
    assert consumer["outputs"]["m_moved"] == producer["outputs"]["m"][MOVED_AFTER:]  # the unmoved continuation
    assert len(set(producer["outputs"]["m"])) > 3


def test_a_local_prefix_hit_inside_a_chunk_loads_the_rest_of_every_group(hybrid_runs: dict[str, Any]) -> None:
    """Prefix caching on (vLLM's default) on a hybrid: the engine's own hit ends inside chunk 0, the store has more."""
    r = hybrid_runs["midchunk"]
    assert r["outputs"]["p"] == hybrid_runs["plain"]["outputs"]["p"]
    whole = 2 * CHUNK  # "p" (300 tokens) has two whole chunks
    local = whole - r["worker_stats"]["tokens_loaded"]
    assert 0 < local < CHUNK and local % BLOCK == 0, r["worker_stats"]  # the hit ended mid-chunk
    assert r["cached"]["p"] == whole, r["cached"]  # vLLM counts its own hit and what was loaded
