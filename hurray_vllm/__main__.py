"""``python -m hurray_vllm``: the ``hurray-vllm`` command line."""

from hurray_vllm.app.cli import main

raise SystemExit(main())
