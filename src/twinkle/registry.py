"""Named component tables: ``set_loss('CrossEntropyLoss')`` looks a name up here.

A registry maps a name to a class. Unknown names fail with the list of valid ones. Names are
never imported as dotted paths, so a request can only reach what the code registered.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, Generic, TypeVar, overload

from twinkle.errors import ConfigurationError, UnknownNameError

T = TypeVar('T')
#: What a registry holds: a class, or a factory function, of its kind of component.
F = TypeVar('F', bound=Callable[..., object])


class Registry(Generic[T]):
    """A table from names to classes (or factories) of one kind of component."""

    def __init__(self, kind: str):
        self.kind = kind
        self._table: dict[str, type[T] | Callable[..., T]] = {}

    @overload
    def register(self, obj: F, *, name: str | None = None) -> F: ...

    @overload
    def register(self, obj: None = None, *, name: str | None = None) -> Callable[[F], F]: ...

    def register(self, obj: F | None = None, *, name: str | None = None) -> F | Callable[[F], F]:
        """Register a class under its own name (or ``name``); usable as a decorator, which hands the
        class back unchanged."""

        def add(target: F) -> F:
            key: str = name or target.__name__
            if key in self._table and self._table[key] is not target:
                raise ConfigurationError(f'{self.kind} {key!r} is already registered')
            # F is a class or factory of this registry's kind; a TypeVar's bound cannot name T to say so.
            self._table[key] = target  # type: ignore[assignment]
            return target

        return add if obj is None else add(obj)

    def get(self, name: str) -> type[T] | Callable[..., T]:
        """The class registered as ``name``; raises ``UnknownNameError`` listing valid names."""
        try:
            return self._table[name]
        except (KeyError, TypeError):
            raise UnknownNameError(self.kind, name, self._table) from None

    def build(self, spec: str | type[T] | T, base: type, **kwargs: Any) -> T:
        """Make a component from a registered name, a subclass of ``base``, or an instance.

        An instance is returned as is (``kwargs`` must then be empty); anything else is an error
        that says which forms are accepted.
        """
        if isinstance(spec, str):
            return self.get(spec)(**kwargs)
        if isinstance(spec, type):
            if issubclass(spec, base):
                return spec(**kwargs)
        elif isinstance(spec, base):
            if kwargs:
                raise ConfigurationError(
                    f'{self.kind} was given as an instance ({type(spec).__name__}); '
                    f'arguments {sorted(kwargs)} cannot be applied to it'
                )
            return spec
        raise ConfigurationError(
            f'{self.kind} must be a registered name, a {base.__name__} subclass or instance; '
            f'got {spec!r}. Registered names: {sorted(self._table)}'
        )

    def names(self) -> list[str]:
        return sorted(self._table)

    def __contains__(self, name: object) -> bool:
        return name in self._table

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(self._table))
