"""Old import paths of modules that moved into the layered package (0.2), kept for one release.

Each old module is a three-line file calling :func:`alias`: it warns once
and puts the new module in its place in ``sys.modules``, so
``import hurray_vllm.store as m`` gives the very module
``hurray_vllm.chunks.store`` (monkeypatching one patches the other).
"""

from __future__ import annotations

import importlib
import sys
import types
import warnings
from typing import Any

__all__ = ["alias"]


class _CallableModule(types.ModuleType):
    """A module that is also its own main function (``hurray_vllm.validate`` was both)."""

    _target: Any = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._target(*args, **kwargs)


def alias(old: str, new: str, *, callable_as: str | None = None) -> None:
    """Make module ``old`` an alias of ``new``, with a ``DeprecationWarning`` naming the new path.

    Args:
        old: the old dotted module name (the caller's ``__name__``).
        new: the module's new dotted name.
        callable_as: name of a function of ``new`` that the old module, when
            called, runs (for an old module that shadowed a function of the
            same name in its package).
    """
    warnings.warn(
        f"{old} moved to {new}; import it from there (the old path goes in hurray-vllm 0.3)",
        DeprecationWarning,
        stacklevel=3,
    )
    module = importlib.import_module(new)
    if callable_as is not None:
        proxy = _CallableModule(old, module.__doc__)
        proxy.__dict__.update({k: v for k, v in vars(module).items() if not k.startswith("__")})
        proxy._target = getattr(module, callable_as)
        sys.modules[old] = proxy
        return
    sys.modules[old] = module
