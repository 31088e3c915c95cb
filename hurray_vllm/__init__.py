"""hurray-vllm: move LLM KV caches between inference engines as Hurray block-paged tensors.

The core (this package) imports no inference engine; adapters for vLLM,
flash-attn, FlashInfer and transformers live in :mod:`hurray_vllm.adapters`.
"""

from __future__ import annotations

from .api import detect_format, load, read_stream, save, write_stream
from .descriptor import TensorDescriptor, decode_descriptor, encode_descriptor
from .errors import HurrayFormatError, Violation
from .paged import BlockPagedTensor, SharingStats
from .snapshot import KVSnapshot, ModelFingerprint, SnapshotSource
from .validate import validate
from .validation import Checked

__version__ = "0.1.0"

__all__ = [
    "BlockPagedTensor",
    "Checked",
    "HurrayFormatError",
    "KVSnapshot",
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
