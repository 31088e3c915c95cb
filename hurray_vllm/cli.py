"""Deprecated: moved to :mod:`hurray_vllm.app.cli` in 0.2; this alias goes in 0.3.

``python -m hurray_vllm.cli`` still runs the command line (so does ``python -m hurray_vllm``).
"""

if __name__ == "__main__":
    from hurray_vllm.app.cli import main

    raise SystemExit(main())
else:
    from ._moved import alias

    alias(__name__, "hurray_vllm.app.cli")
