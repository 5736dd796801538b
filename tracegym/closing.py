"""``ClosesOnExit``: the ``with`` protocol of an object that owns a resource and has ``close()``."""

from __future__ import annotations

from typing import Self

__all__ = ["ClosesOnExit"]


class ClosesOnExit:
    """Base class that makes ``with obj:`` give ``obj`` and call ``obj.close()`` when the block ends."""

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
