"""Each chunk the connector saves names its parent, the key of the chunk before it (no engine needed).

Prune keeps a chunk's parents while it keeps the chunk (``chunks.prune``):
the scheduler knows each chunk's previous key when it plans the save, and
the worker writes it into the chunk's header before the digest and MAC.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import connector_parts
import pytest
import torch
from connector_parts import bare_push_worker, vllm_config

# Module fixtures shared with other connector tests (connector_parts): the connector's worker and metadata modules.
conn, meta = connector_parts.conn, connector_parts.meta


def test_the_scheduler_gives_each_save_the_previous_chunk_s_key(tmp_path: Path, meta: ModuleType) -> None:
    from hurray_vllm.adapters.vllm.connector.config import HurrayConfig
    from hurray_vllm.adapters.vllm.connector.scheduler import HurrayScheduler
    from hurray_vllm.chunks.keys import chunk_keys, tail_keys
    from hurray_vllm.chunks.store import DirectoryStore

    extra = {"hurray_path": str(tmp_path), "hurray_chunk_tokens": 16}
    cfg = HurrayConfig.from_vllm(vllm_config(extra, block_size=4), None)  # type: ignore[arg-type]
    ns = "ab" * 8
    sched = HurrayScheduler(cfg, DirectoryStore(tmp_path), None, ns)  # type: ignore[arg-type]
    tokens = list(range(42))  # two chunks of 16, then a tail of its whole blocks: 32..40
    request = SimpleNamespace(request_id="r", all_token_ids=tokens, num_prompt_tokens=42, kv_transfer_params=None)
    sched.get_num_new_matched_tokens(request, 0)
    state = sched._reqs["r"]
    state.block_ids = list(range(1, 13))
    plan = SimpleNamespace(saves=[])
    sched._plan_saves(plan, "r", state, 42)
    keys = chunk_keys(tokens[:32], 16, ns)
    tail = tail_keys(keys[1], tokens[32:40], 8, ns)[0][1]
    assert [(t.key, t.parent, t.tail) for t in plan.saves] == [
        (keys[0], None, False),
        (keys[1], keys[0], False),
        (tail, keys[1], True),
    ]
    tokens += list(range(100, 106))  # decode completes chunk 2: its parent is chunk 1, not the tail
    plan = SimpleNamespace(saves=[])
    sched._plan_saves(plan, "r", state, 48)
    ((task,),) = [plan.saves]
    assert (task.key, task.parent) == (chunk_keys(tokens, 16, ns)[2], keys[1])
    assert meta.SaveTask("r", "k", [], []).parent is None  # older callers' tasks: no parent


def _worker(conn: ModuleType, meta: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """A bare worker whose real ``_export_chunk`` runs over a stubbed export (one KV head of 8, 4-token blocks)."""
    c = bare_push_worker(conn, meta, tmp_path, None)
    stub = c._export_chunk
    ec = SimpleNamespace(caches=[torch.zeros((16, 4))], layout=None, export_options=lambda: {}, states=None)
    c._engine_cache, c._ec = (lambda: ec), ec

    def export_snapshot(caches: Any, layout: Any, seqs: Any, **kwargs: Any) -> Any:
        (seq,) = seqs
        return stub(ec, caches, SimpleNamespace(tokens=list(seq.token_ids)), seq.block_ids, True)

    monkeypatch.setattr(conn, "export_snapshot", export_snapshot)
    del c._export_chunk  # the class's own
    c._async = False
    return c


def test_the_worker_writes_the_parent_before_the_digest_and_the_mac(
    conn: ModuleType, meta: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from hurray_vllm.chunks.digest import digest_matches
    from hurray_vllm.chunks.keys import PARENT_KEY
    from hurray_vllm.chunks.signing import FleetKeys, check_signature
    from hurray_vllm.errors import HurrayFormatError

    c = _worker(conn, meta, tmp_path, monkeypatch)
    c._keys = FleetKeys.from_secrets(b"k" * 32)
    ec = c._engine_cache()
    first, second = "a1" * 16, "b2" * 16
    snaps = [
        c._export_chunk(ec, ec.caches, meta.SaveTask("r", key, list(range(8)), [1, 2], parent=parent), [1, 2])
        for key, parent in ((first, None), (second, first))
    ]
    assert PARENT_KEY not in snaps[0].extra and snaps[1].extra[PARENT_KEY] == first
    for key, snap in zip((first, second), snaps, strict=True):
        assert digest_matches(snap)
        check_signature(snap, c._keys, c._ns, key)
    forged = replace(snaps[1], extra={**snaps[1].extra, PARENT_KEY: "c3" * 16})
    assert not digest_matches(forged)
    with pytest.raises(HurrayFormatError):
        check_signature(forged, c._keys, c._ns, second)


def test_a_rank_s_slice_names_the_previous_chunk_s_key(
    conn: ModuleType, meta: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """At TP > 1 a task's key becomes this rank's slice name; its parent stays the chunk key before it."""
    from hurray_vllm.chunks.keys import PARENT_KEY
    from hurray_vllm.chunks.store import read_header
    from hurray_vllm.kv.snapshot import HeadRange

    c = _worker(conn, meta, tmp_path, monkeypatch)
    c._my_heads = HeadRange(1, 2, 2)
    first, second = "a1" * 16, "b2" * 16
    tasks = [
        meta.SaveTask("r", first, list(range(8)), [1, 2]),
        meta.SaveTask("r", second, list(range(8, 16)), [3, 4], parent=first),
    ]
    c.wait_for_save(meta.HurrayConnectorMetadata(saves=tasks))
    assert c.flush(timeout=30) and c.stats.chunks_saved == 2, c.stats
    headers = [read_header(c._store.path(c._ns, f"{k}.h1-2")) for k in (first, second)]
    assert [h.extra.get(PARENT_KEY) for h in headers if h is not None] == [None, first]
