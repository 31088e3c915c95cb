"""Which requests and roles share chunks: ``kv_producer`` / ``kv_consumer``, ``cache_salt``, LoRA, multimodal inputs.

Real engines (CPU) for the roles and for ``cache_salt``; the scheduler alone
for LoRA adapters and multimodal or embedding prompts, which the tiny CPU
engine does not run.

* A ``kv_producer`` saves every request (it used to save none: the
  scheduler only followed requests it was asked to load for), a
  ``kv_consumer`` loads and saves nothing.
* The same tokens under another ``cache_salt`` (vLLM's per-tenant cache
  isolation) or another LoRA adapter are other KV: their chunks get keys of
  their own.
* Images and prompt embeddings decide KV that token ids do not name: such
  requests are neither loaded nor saved.
* An engine that overrides the checkpoint's config (a rope base or scaling
  through ``hf_overrides``) computes other KV from the same files: it has a
  namespace of its own.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from conftest import require
from connector_parts import linear_scheduler, vllm_config
from prefetch import prefetched
from servers import run_engine, side_by_side
from tiny_models import build_tiny_llama

pytestmark = [pytest.mark.vllm]
BLOCK = CHUNK = 32
P = [(i * 37 + 11) % 500 + 1 for i in range(100)]  # three whole chunks before its last token


def _files(store: Path) -> set[str]:
    return {p.name for p in store.rglob("*.hrry")}


@pytest.fixture(scope="module")
@prefetched
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    require("vllm")
    tmp = tmp_path_factory.mktemp("connector-requests")
    build_tiny_llama(tmp / "model")
    store = tmp / "store"
    extra = {"hurray_path": str(store), "hurray_chunk_tokens": CHUNK}
    out: dict[str, Any] = {"store": store}
    out["producer"] = run_engine(
        tmp, "producer", BLOCK, extra, {"p": P, "salted": P}, 8, role="kv_producer", salts={"salted": "tenant-a"}
    )
    out["saved"] = _files(store)
    # Consumers only read the store: they run side by side.
    out |= side_by_side(
        {
            "consumer": lambda: run_engine(
                tmp,
                "consumer",
                BLOCK,
                extra,
                {"none": P, "same": P, "other": P},
                8,
                role="kv_consumer",
                salts={"same": "tenant-a", "other": "tenant-b"},
            ),
            # The same checkpoint with another rope base: every key is rotated otherwise.
            "rope": lambda: run_engine(
                tmp,
                "rope",
                BLOCK,
                extra,
                {"p": P},
                8,
                role="kv_consumer",
                engine={"hf_overrides": {"rope_theta": 500.0}},
            ),
            # A weight update resets the caches (pause_generation(clear_cache=True)): the same prompt again
            # must not load the chunks of the weights before. A store of its own: the others' keys stay put.
            "reset": lambda: run_engine(
                tmp,
                "reset",
                BLOCK,
                {**extra, "hurray_path": str(tmp / "reset-store")},
                {"first": P, "again": P, "third": P},
                4,
                sequential=True,
                engine={"reset_before": ["again"]},
            ),
            # Parallel sampling (OpenAI's n): vLLM fans the request out into children that share its prompt.
            "sampled": lambda: run_engine(
                tmp,
                "sampled",
                BLOCK,
                extra,
                {"p": P},
                8,
                role="kv_consumer",
                engine={"sampling": {"n": 3, "temperature": 0.8, "seed": 7}},
            ),
        }
    )
    out["after"] = _files(store)
    return out


def test_a_producer_saves_each_salt_apart_and_a_consumer_loads_only_its_own(runs: dict[str, Any]) -> None:
    producer, consumer = runs["producer"], runs["consumer"]
    assert len(runs["saved"]) == 2 * 3  # three whole chunks per salt (chunks of one block: no tail)
    assert producer["worker_stats"]["chunks_saved"] == 6
    # No salt loads the unsalted chunks, tenant-a its own, tenant-b none (vLLM's own cache keeps them apart too).
    assert consumer["cached"] == {"none": 96, "same": 96, "other": 0}
    assert consumer["scheduler_stats"]["chunks_refused"] == 0
    want = producer["outputs"]["p"]
    assert consumer["outputs"] == {"none": want, "same": want, "other": want}
    assert runs["after"] == runs["saved"]  # a consumer saves nothing


def test_a_cache_reset_gives_the_engine_keys_of_its_own(runs: dict[str, Any]) -> None:
    """vLLM's ``reset_prefix_cache(reset_connector=True)`` (before a weight update): nothing saved before loads.

    The second run of the prompt comes after the reset: it loads nothing (with
    the old keys it loaded 96 tokens of the weights before) and saves its
    chunks anew, under keys of their own; the third finds them in vLLM's own
    prefix cache.
    """
    reset = runs["reset"]
    assert reset["resets"] == {"again": True}
    assert reset["cached"]["first"] == 0 and reset["cached"]["again"] == 0
    assert reset["scheduler_stats"]["cache_resets"] == 1
    assert reset["worker_stats"]["chunks_saved"] == 6 and reset["worker_stats"]["chunks_loaded"] == 0
    assert len(_files(runs["store"].parent / "reset-store")) == 6


def test_a_reset_forgets_what_requests_in_flight_saved_and_keys_new_ones_apart(tmp_path: Path) -> None:
    sched = _scheduler(tmp_path)
    before = _request("before")
    sched.get_num_new_matched_tokens(before, 0)
    state = sched._reqs["before"]
    state.block_ids = [1, 2, 3]
    meta = SimpleNamespace(saves=[])
    sched._plan_saves(meta, "before", state, 40)
    old_keys = [t.key for t in meta.saves]
    assert len(old_keys) == 2
    assert sched.reset_cache() is True
    # A request running on KV computed before the reset saves nothing more and announces nothing.
    meta = SimpleNamespace(saves=[])
    sched._plan_saves(meta, "before", state, 40)
    assert meta.saves == [] and sched.request_finished(before) == (False, None)
    after = _request("after")
    sched.get_num_new_matched_tokens(after, 0)
    state = sched._reqs["after"]
    state.block_ids = [4, 5, 6]
    sched._plan_saves(meta, "after", state, 40)
    new_keys = [t.key for t in meta.saves]
    assert len(new_keys) == 2 and not set(new_keys) & set(old_keys)
    assert sched.stats.cache_resets == 1


def _scheduler(tmp_path: Path) -> Any:
    from hurray_vllm.adapters.vllm.connector.config import HurrayConfig
    from hurray_vllm.adapters.vllm.connector.scheduler import HurrayScheduler
    from hurray_vllm.chunks.store import DirectoryStore

    cfg = HurrayConfig.from_vllm(vllm_config({"hurray_path": str(tmp_path), "hurray_chunk_tokens": 16}), None)  # type: ignore[arg-type]
    return HurrayScheduler(cfg, DirectoryStore(tmp_path), None, "ab" * 8)  # type: ignore[arg-type]


def _request(rid: str, **fields: Any) -> SimpleNamespace:
    tokens = list(range(40))
    return SimpleNamespace(
        request_id=rid, all_token_ids=tokens, num_prompt_tokens=40, kv_transfer_params=None, **fields
    )


def test_lora_adapters_and_salts_seed_their_own_keys_and_multimodal_requests_have_none(tmp_path: Path) -> None:
    require("vllm")
    from hurray_vllm.adapters.vllm.connector.scheduler import request_seed

    ns = "ab" * 8
    for v in ("sql-v1", "sql-v2"):
        (tmp_path / v).mkdir()
        (tmp_path / v / "adapter_model.safetensors").write_bytes(v.encode())
    lora = SimpleNamespace(lora_name="sql", lora_path=str(tmp_path / "sql-v1"))
    moved = SimpleNamespace(lora_name="sql", lora_path=str(tmp_path / "sql-v2"))
    seeds = [
        request_seed(ns, _request("plain")),
        request_seed(ns, _request("lora", lora_request=lora)),
        request_seed(ns, _request("lora2", lora_request=moved)),  # the same name, another adapter
        request_seed(ns, _request("salted", cache_salt="t1")),
        request_seed(ns, _request("both", lora_request=lora, cache_salt="t1")),
    ]
    assert seeds[0] == ns and len(set(seeds)) == len(seeds)
    assert request_seed(ns, _request("same", lora_request=lora)) == seeds[1]
    assert request_seed(ns, _request("image", mm_features=[object()])) is None
    assert request_seed(ns, _request("embeds", prompt_embeds=object())) is None
    assert request_seed(ns, _request("no images", mm_features=[])) == ns
    # No files here to key by (a path elsewhere, a hub id not downloaded): no chunks, never by name and path.
    gone = SimpleNamespace(lora_name="sql", lora_path="/nonexistent/adapters/sql")
    assert request_seed(ns, _request("gone", lora_request=gone)) is None

    sched = _scheduler(tmp_path)
    image = _request("image", mm_features=[object()])
    assert sched.get_num_new_matched_tokens(image, 0) == (0, False)
    meta = SimpleNamespace(saves=[])
    state = sched._reqs["image"]
    state.block_ids = [1, 2, 3]
    sched._plan_saves(meta, "image", state, 40)
    assert meta.saves == []  # neither loaded nor saved
    plain = _request("plain")
    sched.get_num_new_matched_tokens(plain, 0)
    state = sched._reqs["plain"]
    state.block_ids = [4, 5, 6]
    sched._plan_saves(meta, "plain", state, 40)
    assert [t.key for t in meta.saves][:2] and len(meta.saves) == 2  # its two whole chunks of 16


def test_a_step_past_the_requests_token_ids_saves_only_chunks_of_final_tokens(tmp_path: Path) -> None:
    """Speculative drafts (or asynchronous scheduling) put the step's end past the token ids: no chunk past them."""
    sched = _scheduler(tmp_path)
    request = _request("r")  # 40 tokens: chunks of 16 end at 16 and 32
    sched.get_num_new_matched_tokens(request, 0)
    state = sched._reqs["r"]
    state.block_ids = [1, 2, 3, 4]
    meta = SimpleNamespace(saves=[])
    sched._plan_saves(meta, "r", state, 44)  # 4 draft tokens past the 40 it holds
    assert [t.tokens for t in meta.saves] == [list(range(16)), list(range(16, 32))]


def test_a_chunk_saved_a_step_late_carries_no_states(tmp_path: Path) -> None:
    """Linear attention: states are the engine's at the step's end; a chunk planned after its step gets none."""
    sched = linear_scheduler(tmp_path)
    request = SimpleNamespace(request_id="r", all_token_ids=list(range(64)), num_prompt_tokens=40)
    state = sched._state(request)
    state.groups = [[0, 11], [0, 21], [31, 32]]
    state.block_ids = list(state.groups[0])
    meta = SimpleNamespace(saves=[])
    sched._plan_saves(meta, "r", state, 65)  # the token ids trail the step's end (65) by one
    assert [(t.tokens[-1], t.state_blocks) for t in meta.saves][-1] == (63, {})
    request = SimpleNamespace(request_id="s", all_token_ids=list(range(100, 164)), num_prompt_tokens=40)
    state = sched._state(request)
    state.groups = [[0, 11], [0, 21], [31, 32]]
    state.block_ids = list(state.groups[0])
    meta = SimpleNamespace(saves=[])
    sched._plan_saves(meta, "s", state, 64)  # the step ended at the chunk's end: its states are there
    assert meta.saves[-1].state_blocks == {0: [11], 1: [21]} and meta.saves[-1].state_position == 64


def test_a_salted_requests_tail_is_keyed_with_its_salt(tmp_path: Path) -> None:
    """``hurray_tails``: the tail chains on the salted chunk before it, and a salted consumer finds it."""
    from hurray_vllm.adapters.vllm.connector.config import HurrayConfig
    from hurray_vllm.adapters.vllm.connector.scheduler import HurrayScheduler
    from hurray_vllm.chunks.keys import chunk_keys, key_seed, tail_keys
    from hurray_vllm.chunks.store import DirectoryStore

    extra = {"hurray_path": str(tmp_path), "hurray_chunk_tokens": 16}
    cfg = HurrayConfig.from_vllm(vllm_config(extra, block_size=4), None)  # type: ignore[arg-type]
    sched = HurrayScheduler(cfg, DirectoryStore(tmp_path), None, "ab" * 8)  # type: ignore[arg-type]
    tokens = list(range(22))  # one chunk (16) and a tail of one... of its whole blocks after it: 16..20
    request = SimpleNamespace(
        request_id="r", all_token_ids=tokens, num_prompt_tokens=22, kv_transfer_params=None, cache_salt="t1"
    )
    sched.get_num_new_matched_tokens(request, 0)
    state = sched._reqs["r"]
    state.block_ids = [1, 2, 3, 4, 5, 6]
    meta = SimpleNamespace(saves=[])
    sched._plan_saves(meta, "r", state, 22)
    seed = key_seed("ab" * 8, cache_salt="t1")
    (first,) = chunk_keys(tokens[:16], 16, seed)
    assert [t.key for t in meta.saves] == [first, tail_keys(first, tokens[16:20], 4, seed)[0][1]]
    assert meta.saves[-1].tail and first != chunk_keys(tokens[:16], 16, "ab" * 8)[0]


def test_a_local_lora_adapter_is_keyed_by_its_files(tmp_path: Path) -> None:
    """Not by where it lies: another path to the same files shares; a rewritten adapter does not."""
    require("vllm")
    import os
    import shutil

    from hurray_vllm.adapters.vllm.connector.scheduler import request_seed

    one, two = tmp_path / "one", tmp_path / "two"
    one.mkdir()
    (one / "adapter_config.json").write_text('{"r": 8}')
    (one / "adapter_model.safetensors").write_bytes(bytes(range(256)) * 600)
    shutil.copytree(one, two)

    def seed(name: str, path: Path) -> str | None:
        return request_seed("ns", _request(name, lora_request=SimpleNamespace(lora_name=name, lora_path=str(path))))

    first = seed("sql", one)
    assert first == seed("sql-copy", two) != "ns"  # the same files under another name and path
    weights = one / "adapter_model.safetensors"
    data = bytearray(weights.read_bytes())
    data[100] ^= 1
    weights.write_bytes(bytes(data))
    os.utime(weights, ns=(1, 1))  # even with an older time: size, inode or time differ, and the bytes do
    assert seed("sql", one) not in (first, None)


def test_a_snapshot_of_a_salted_request_is_stored_under_the_keys_its_connector_uses(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """``snapshot()`` records a salted request's key seed; ``store_snapshot`` then writes the very files the
    engine's own connector saved for the same requests (a plain request's, and the salted one's apart)."""
    import json

    from engine_script import run_engine_script

    import hurray_vllm as hv
    from hurray_vllm.chunks.keys import KEY_SEEDS
    from hurray_vllm.chunks.store import DirectoryStore, store_snapshot

    require("vllm")
    tmp = tmp_path_factory.mktemp("salted-snapshot")
    build_tiny_llama(tmp / "model")
    cfg = {
        "model": str(tmp / "model"),
        "store": str(tmp / "store"),
        "tp": 1,
        "block": BLOCK,
        "chunk": CHUNK,
        "max_model_len": 1024,
        "phases": [{"prompts": {"p": P, "salted": P}, "salts": {"salted": "tenant-a"}, "snapshot": True}],
    }
    (tmp / "run.json").write_text(json.dumps(cfg))
    run = run_engine_script("hybrid_tp_run.py", [str(tmp / "run.json"), str(tmp / "run")], tmp / "run", "salted")
    snap = hv.load(run["dir"] / "snap0.hrry")
    assert set(snap.extra[KEY_SEEDS]) == {"salted"}  # only the request whose keys are not plain
    mine = DirectoryStore(tmp / "mine")
    assert store_snapshot(mine, snap, CHUNK, tails=False) == 2 * 3
    ours = {p.relative_to(tmp / "mine") for p in (tmp / "mine").rglob("*.hrry")}
    theirs = {p.relative_to(tmp / "store") for p in (tmp / "store").rglob("*.hrry")}
    assert ours == theirs  # the connector saved three whole chunks per salt, under these names


def test_a_request_asking_for_prompt_logprobs_reads_no_chunks_and_is_still_saved(tmp_path: Path) -> None:
    """vLLM computes every prompt token of such a request (``skip_reading_prefix_cache``) and drops loads."""
    require("vllm")
    sched = _scheduler(tmp_path)
    asked: list[str] = []
    store = sched._store
    sched._store = SimpleNamespace(
        parts=lambda ns, key, heads: asked.append(key) or store.parts(ns, key, heads),
        complete_sets=lambda ns, key, heads: asked.append(key) or store.complete_sets(ns, key, heads),
        reader=store.reader,
        has=store.has,
        identity=store.identity,
    )
    assert sched.get_num_new_matched_tokens(_request("logprobs", skip_reading_prefix_cache=True), 0) == (0, False)
    assert asked == []  # no chunk looked up, read or checked
    sched.get_num_new_matched_tokens(_request("plain"), 0)
    assert asked  # the same prompt without them is looked up
    meta = SimpleNamespace(saves=[])
    state = sched._reqs["logprobs"]
    state.block_ids = [1, 2, 3]
    sched._plan_saves(meta, "logprobs", state, 40)
    assert len(meta.saves) == 2  # its KV is computed as any other's: saved


def test_an_engine_overriding_the_rope_loads_nothing_the_plain_engine_saved(runs: dict[str, Any]) -> None:
    rope = runs["rope"]
    assert rope["cached"] == {"p": 0}  # it used to load the plain engine's three chunks, keys rotated otherwise
    assert rope["scheduler_stats"]["chunks_refused"] == 0  # another namespace: never even looked at


def test_a_request_sampled_n_times_loads_the_chunks_of_its_prompt(runs: dict[str, Any]) -> None:
    sampled = runs["sampled"]
    samples = sampled["samples"]["p"]
    assert len(samples) == 3 and all(len(x) == 8 for x in samples) and len({tuple(x) for x in samples}) > 1
    assert sampled["worker_stats"]["chunks_loaded"] >= 3  # the prompt's three chunks, for one child or more
    assert sampled["worker_stats"]["loads_failed"] == 0 and sampled["scheduler_stats"]["chunks_refused"] == 0


def test_a_lora_adapter_under_home_is_keyed_by_its_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM expands ``~`` in a LoRA path: so must the key, or an adapter rewritten there keeps its old chunks."""
    require("vllm")
    import os

    from hurray_vllm.adapters.vllm.connector.scheduler import request_seed

    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "sql").mkdir()
    weights = tmp_path / "sql" / "adapter_model.safetensors"
    weights.write_bytes(b"A" * 1000)
    lora = SimpleNamespace(lora_name="sql", lora_path="~/sql")
    first = request_seed("ns", _request("a", lora_request=lora))
    weights.write_bytes(b"B" * 1000)
    os.utime(weights, ns=(1, 1))
    assert None is not first != request_seed("ns", _request("b", lora_request=lora))
