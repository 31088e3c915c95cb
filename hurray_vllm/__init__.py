"""hurray-vllm: move LLM KV caches between inference engines as Hurray block-paged tensors.

The package is layered (docs/architecture.md; ``make lint`` checks it):
:mod:`.wire` (bytes <-> descriptors) < :mod:`.kv` (BlockPagedTensor,
KVSnapshot, repaging) < :mod:`.containers` (.hrrs, .hrry, .safetensors,
save/load) < :mod:`.chunks` (the chunk store) < :mod:`.transport` (TCP,
NIXL) < :mod:`.adapters` (one per engine) < :mod:`.app` (command line,
demo). Only :mod:`.app` imports adapters; this top level imports no engine.
"""

from __future__ import annotations

from .containers.check import validate
from .containers.io import detect_format, load, read_stream, save, write_stream
from .errors import HurrayArgumentError, HurrayFormatError, ImportArgumentError, Violation
from .kv.paged import BlockPagedTensor, SharingStats
from .kv.snapshot import HeadRange, KVSnapshot, LatentSplit, ModelFingerprint, SlidingWindows, SnapshotSource
from .kv.states import RecurrentStates
from .wire.descriptor import TensorDescriptor, decode_descriptor, encode_descriptor
from .wire.rules import Checked

__version__ = "0.2.0.dev0"

__all__ = [
    "BlockPagedTensor",
    "Checked",
    "HurrayArgumentError",
    "HurrayFormatError",
    "ImportArgumentError",
    "KVSnapshot",
    "LatentSplit",
    "SlidingWindows",
    "RecurrentStates",
    "HeadRange",
    "ModelFingerprint",
    "SharingStats",
    "SnapshotSource",
    "TensorDescriptor",
    "Violation",
    "decode_descriptor",
    "detect_format",
    "encode_descriptor",
    "load",
    "read_stream",
    "save",
    "validate",
    "write_stream",
    "__version__",
]
