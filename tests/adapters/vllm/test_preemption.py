"""HurrayConnector in an engine whose KV cache is too small for its requests: vLLM preempts and resumes them.

Six requests of 100 prompt and 120 generated tokens share 16 blocks of 32
tokens, so vLLM preempts requests (freeing their blocks) and resumes them
later from scratch. A resumed request asks the connector again: it loads
the chunks it saved itself before its blocks were taken, where vLLM's own
prefix cache lost them. The greedy tokens equal those of the same engine
without the connector (preempted the same way, recomputing).
"""

from __future__ import annotations

from typing import Any

import pytest
from conftest import require
from prefetch import prefetched
from servers import run_engine, side_by_side
from tiny_models import build_tiny_llama

pytestmark = [pytest.mark.vllm]
BLOCK = CHUNK = 32
PROMPTS = {f"r{k}": [(i * (37 + k) + 11 * k) % 500 + 1 for i in range(100)] for k in range(6)}
SMALL = {"max_model_len": 256, "num_blocks": 16}


@pytest.fixture(scope="module")
@prefetched
def preempted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    require("vllm")
    tmp = tmp_path_factory.mktemp("preemption")
    build_tiny_llama(tmp / "model")
    extra = {"hurray_path": str(tmp / "store"), "hurray_chunk_tokens": CHUNK}
    return side_by_side(
        {
            "plain": lambda: run_engine(tmp, "plain", BLOCK, None, PROMPTS, 120, engine=SMALL),
            "connector": lambda: run_engine(tmp, "connector", BLOCK, extra, PROMPTS, 120, engine=SMALL),
        }
    )


def test_preempted_requests_resume_with_identical_tokens_loading_their_own_chunks(preempted: dict[str, Any]) -> None:
    plain, run = preempted["plain"], preempted["connector"]
    assert run["outputs"] == plain["outputs"]
    assert len(set(plain["outputs"]["r0"])) > 3
    work = run["worker_stats"]
    assert work["chunks_saved"] >= 6 * 6  # every request's whole chunks: 219 tokens computed, 6 chunks each
    assert work["tokens_loaded"] > 0 and work["loads_failed"] == 0  # resumed requests loaded what they saved
