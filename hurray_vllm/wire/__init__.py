"""The wire format: bytes <-> descriptors.

* :mod:`.descriptor`: the common descriptor header and the block-paged layout codec;
* :mod:`.dtypes`: Hurray element types and their torch equivalents;
* :mod:`.rules`: every validation rule of a descriptor and its buffers;
* :mod:`.crc32c`: the checksum of files and chunks.

Imports nothing of hurray-vllm above it (only :mod:`hurray_vllm.errors` and
:mod:`hurray_vllm.native`).
"""

__all__: list[str] = []  # the modules are the API: import from them
