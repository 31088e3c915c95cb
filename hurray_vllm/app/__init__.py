"""Applications: the ``hurray-vllm`` command line and the demo. The only layer that imports adapters."""

__all__: list[str] = []  # the modules are the API: import from them
