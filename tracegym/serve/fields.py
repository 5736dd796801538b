"""Typed reads of request-body fields: a missing field gives the default, a wrong one a 400 naming it."""

from __future__ import annotations

import math
from typing import Any

from tracegym.serve.errors import bad_request


def is_number(value: Any) -> bool:
    """A finite int or float (``bool`` is not a number here, though Python says it is)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def number_field(body: dict[str, Any], key: str, default: float, low: float, high: float) -> float:
    value = body.get(key)
    if value is None:
        return default
    if not is_number(value) or not low <= value <= high:
        raise bad_request(f"{key} must be a number in [{low:g}, {high:g}], got {value!r}", key)
    return float(value)


def integer_field(body: dict[str, Any], key: str, default: int) -> int:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad_request(f"{key} must be an integer, got {value!r}", key)
    return value


def boolean_field(body: dict[str, Any], key: str, default: bool) -> bool:
    value = body.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad_request(f"{key} must be a boolean, got {value!r}", key)
    return value
