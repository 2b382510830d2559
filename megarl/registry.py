"""A small name -> callable registry, so a config can say ``policy_loss: gspo``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

F = TypeVar("F", bound=Callable)


class Registry(Generic[F]):
    """Named callables of one kind (policy losses, advantage estimators, ...)."""

    def __init__(self, kind: str):
        self.kind = kind
        self._items: dict[str, F] = {}

    def register(self, name: str) -> Callable[[F], F]:
        """Decorator: register ``fn`` under ``name`` (a name may be registered once)."""
        def deco(fn: F) -> F:
            if name in self._items:
                raise ValueError(f"{self.kind} {name!r} is already registered")
            self._items[name] = fn
            return fn
        return deco

    def get(self, name: str) -> F:
        """The callable registered as ``name``; a KeyError lists the allowed names."""
        try:
            return self._items[name]
        except KeyError:
            raise KeyError(f"unknown {self.kind} {name!r}; allowed: {', '.join(sorted(self._items))}") from None

    def names(self) -> list[str]:
        return sorted(self._items)

    def __contains__(self, name: str) -> bool:
        return name in self._items
