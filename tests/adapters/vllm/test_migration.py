"""Two vLLM OpenAI servers on 127.0.0.1: a completion migrated over TCP mid-decode equals an unmoved run."""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from conftest import require
from servers import ROOT, ServerSpec, run_engine, start_servers, stop_servers
from tiny_models import build_tiny_llama

from hurray_vllm.adapters.vllm.migrate import MigrationResult
from hurray_vllm.app.cli import main

pytestmark = [pytest.mark.vllm]
PROMPT = [(i * 53 + 7) % 500 + 1 for i in range(200)]


def _server(tmp: Path, name: str, port: int, block_size: int, extra: dict[str, object]) -> ServerSpec:
    kv = {
        "kv_connector": "HurrayConnector",
        "kv_connector_module_path": "hurray_vllm.adapters.vllm.connector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": extra,
    }
    cmd = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(tmp / "model"), "--skip-tokenizer-init", "--enforce-eager", "--dtype", "bfloat16",
        "--max-model-len", "1024", "--block-size", str(block_size),  # prefix caching on: the default
        "--host", "127.0.0.1", "--port", str(port), "--enable-prompt-tokens-details",
        "--kv-transfer-config", json.dumps(kv),
    ]  # fmt: skip
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "PYTHONPATH": str(ROOT)}
    return ServerSpec(name, cmd, port, env)


@pytest.fixture(scope="module", params=["tcp", "nixl"])
def servers(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, str, Path, Path]]:
    require("vllm")
    require("transformers")
    transport = request.param
    if transport == "nixl":
        require("nixl_cu12")
    tmp = tmp_path_factory.mktemp(f"migration-{transport}")
    build_tiny_llama(tmp / "model")

    def specs(port: Callable[[], int]) -> list[ServerSpec]:
        recv = port()
        b_extra = {"hurray_path": str(tmp / "b"), "hurray_listen": f"127.0.0.1:{recv}",
                   "hurray_listen_transport": transport, "hurray_chunk_tokens": 64}  # fmt: skip
        a_extra = {"hurray_path": str(tmp / "a"), "hurray_url": f"{transport}://127.0.0.1:{recv}",
                   "hurray_chunk_tokens": 64}  # fmt: skip
        return [_server(tmp, "a", port(), 32, a_extra), _server(tmp, "b", port(), 64, b_extra)]

    a, b = start_servers(specs, tmp / "logs")
    try:
        yield a.url, b.url, tmp, tmp / "b"
    finally:
        stop_servers([a, b])


def test_migrated_completion_equals_unmoved_run(servers) -> None:  # type: ignore[no-untyped-def]
    src, dst, tmp, b_store = servers
    assert not b_store.exists() or not any(b_store.rglob("*.hrry"))  # nothing arrived yet
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = main(["migrate", "--from", src, "--to", dst, "--prompt-ids", ",".join(map(str, PROMPT)),
                   "--after", "9", "--max-tokens", "24", "--json"])  # fmt: skip
    assert rc == 0
    moved = MigrationResult(**{k: v for k, v in json.loads(buf.getvalue()).items() if k != "tokens"})
    # The unmoved reference: a plain engine without connector, same model and prompt.
    plain = run_engine(tmp, "plain", 32, None, {"m": PROMPT}, max_tokens=24)
    assert moved.tokens == plain["outputs"]["m"]
    # The destination got the chunks over TCP and did not recompute them: 209 tokens -> 3 chunks of 64.
    assert len(list(b_store.rglob("*.hrry"))) >= 3
    assert moved.destination_cached_tokens == 192
    assert len(moved.tokens) == 24
