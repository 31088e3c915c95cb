"""vLLM's OpenAI server (``vllm.entrypoints.openai.api_server``) with :mod:`vllm_patches` applied.

For servers that keep vLLM's asynchronous scheduling (``--async-scheduling``),
which the CPU platform would turn off. The engine's configuration is made in
this process and handed to its engine core as it is.
"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from vllm_patches import keep_async_scheduling

if __name__ == "__main__":
    keep_async_scheduling()
    runpy.run_module("vllm.entrypoints.openai.api_server", run_name="__main__", alter_sys=True)
