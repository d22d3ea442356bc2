"""What ``remote_class`` records on a class, and what a driver-side handle to its actors is.

``hook.py`` writes these (``remote_class``); ``proxy.py`` reads them when it builds the actors
(``method_dispatch``, ``accepts_argument``) and subclasses ``RemoteHandle``. Keeping them here
lets ``hook`` reach ``proxy`` (for ray mode) without ``proxy`` importing ``hook`` back.
This module imports no Ray.
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any

from twinkle.infra.ray.dispatch import DEFAULT_DISPATCH, Dispatch

# Where remote_class keeps a class's method table and its undecorated __init__.
METHODS_ATTR = '__twinkle_remote_methods__'
INIT_ATTR = '__twinkle_remote_init__'


class RemoteHandle:
    """What every driver-side handle to a remote component is (``proxy.RemoteComponent``); code
    that accepts either a local component or a remote one checks for it (``isinstance``)."""

    #: The component class the actors hold.
    remote_class: type

    def remote_execute(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """Run ``fn(component, *args, **kwargs)`` on the actors."""
        raise NotImplementedError

    if TYPE_CHECKING:
        # A handle forwards the component's methods and attributes to its actors.
        def __getattr__(self, name: str) -> Any: ...


def method_dispatch(cls: type, name: str) -> Dispatch:
    """How ``cls.name`` runs remotely: its declared ``Dispatch`` (inherited), else ``('all', 'first')``."""
    table: dict[str, Dispatch] = getattr(cls, METHODS_ATTR, {})  # remote_class sets it
    return table.get(name, DEFAULT_DISPATCH)


def accepts_argument(cls: type, name: str) -> bool:
    """Whether ``cls``'s own ``__init__`` names a parameter ``name`` (not merely ``**kwargs``)."""
    constructor: Any = cls  # a class's own __init__, read off the class itself
    init = getattr(cls, INIT_ATTR, constructor.__init__)
    return name in inspect.signature(init).parameters


__all__ = ['INIT_ATTR', 'METHODS_ATTR', 'RemoteHandle', 'accepts_argument', 'method_dispatch']
