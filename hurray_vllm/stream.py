"""Deprecated: moved to :mod:`hurray_vllm.containers.stream` in 0.2; this alias goes in 0.3."""

from ._moved import alias

alias(__name__, "hurray_vllm.containers.stream")
