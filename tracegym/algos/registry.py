"""Name -> function registries for advantage estimators and policy losses.

Each algorithm file registers itself with a decorator; ``tracegym.algos`` imports every file so the
registries are complete once the package is imported. Unknown names raise a ``KeyError`` that lists
the registered names and the nearest one.
"""

from __future__ import annotations

import difflib
from typing import Callable, Generic, Iterator, TypeVar

F = TypeVar("F", bound=Callable)


class Registry(Generic[F]):
    """A small typed mapping from a name to a function, filled by ``@registry.register(name)``."""

    def __init__(self, kind: str):
        self.kind = kind
        self._items: dict[str, F] = {}

    def register(self, name: str) -> Callable[[F], F]:
        def decorator(fn: F) -> F:
            if name in self._items and self._items[name] is not fn:
                raise ValueError(f"{self.kind} {name!r} is already registered")
            self._items[name] = fn
            return fn

        return decorator

    def get(self, name: str) -> F:
        try:
            return self._items[name]
        except KeyError:
            close = difflib.get_close_matches(name, self._items, n=1)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            raise KeyError(
                f"unknown {self.kind} {name!r}.{hint} Registered: {', '.join(sorted(self._items))}"
            ) from None

    def names(self) -> list[str]:
        return sorted(self._items)

    def __contains__(self, name: object) -> bool:
        return name in self._items

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self._items)


ADVANTAGE_ESTIMATORS: Registry[Callable] = Registry("advantage estimator")
"""``(rewards [N] float, group_ids [N] long, **options) -> advantages [N] float``."""

POLICY_LOSSES: Registry[Callable] = Registry("policy loss")
"""``(logprobs, old_logprobs, advantages, mask, cfg, *, token_weights, entropy, normalizers)
-> (loss scalar, metrics dict)``; every tensor is ``[B, T]``, target-aligned."""
