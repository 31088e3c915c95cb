"""Deprecated: moved to :mod:`hurray_vllm.containers.check` in 0.2; this alias goes in 0.3.

``hurray_vllm.validate`` is also the function :func:`hurray_vllm.validate`;
importing this module keeps that name callable.
"""

from ._moved import alias

alias(__name__, "hurray_vllm.containers.check", callable_as="validate")
