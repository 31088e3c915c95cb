"""Applications: the ``hurray-vllm`` command line and the demo. The only layer that imports adapters."""
