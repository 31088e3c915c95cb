"""Chunks a worker pushes on from its store: a copy with linear-attention states reaches a receiver holding one
without them (no engine needed)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch
from conftest import require
from connector_parts import bare_push_worker


def test_a_stored_chunk_with_states_is_pushed_on_to_a_receiver_holding_it_without(tmp_path: Path) -> None:
    """Found by a review: the receiver answered "held" for its stateless copy, so the stateful one never went
    (and a load there resumed earlier). A stateless copy here still goes nowhere the receiver holds it."""
    require("vllm")
    from synthetic import example_chunk

    import hurray_vllm as hv
    import hurray_vllm.adapters.vllm.connector.metadata as meta
    import hurray_vllm.adapters.vllm.connector.worker as conn
    from hurray_vllm.chunks.store import DIGEST_KEY, DirectoryStore, chunk_digest
    from hurray_vllm.transport import sender_for
    from hurray_vllm.transport.tcp import Receiver

    ns, _key, chunk = example_chunk()
    states = hv.RecurrentStates(
        "gdn_attn", (chunk.num_layers,), ("conv", "ssm"), (4,), ((torch.ones(1, 3, 16), torch.ones(1, 2, 8, 8)),)
    )
    with_states = replace(chunk, states=states)
    with_states = replace(with_states, extra={**with_states.extra, DIGEST_KEY: chunk_digest(with_states)})
    stateful, stateless = "aa" * 8, "bb" * 8
    dest = DirectoryStore(tmp_path / "dest")
    for key in (stateful, stateless):  # the receiver holds both chunks without states (a step ran past their end)
        dest.put(ns, key, chunk)
    with Receiver("127.0.0.1", 0, DirectoryStore(tmp_path / "dest"), timeout=5).start() as r:
        url = f"tcp://127.0.0.1:{r.address[1]}"
        c = bare_push_worker(conn, meta, tmp_path / "here", sender_for(url))
        c._url, c._ns, c._fingerprint, c._async = url, ns, chunk.fingerprint, False
        c._store.put(ns, stateful, with_states)
        c._store.put(ns, stateless, chunk)
        forwards = [meta.SaveTask("r", k, list(range(8)), [], forward=True) for k in (stateful, stateless)]
        c.wait_for_save(meta.HurrayConnectorMetadata(saves=forwards))
        assert c.flush(timeout=30)
        assert dest.has_states(ns, stateful) and not dest.has_states(ns, stateless)
        assert r.received == 1 and c.stats.chunks_forwarded == 1 and c.stats.chunks_held == 1
        c.wait_for_save(meta.HurrayConnectorMetadata(saves=forwards))  # pushed once: not again
        assert c.flush(timeout=30) and r.received == 1 and c.stats.push_failures == 0
