"""Checks of the values a saved `auto` state holds (jetflow/decoding/budget.py, mode_policy.py): a
damaged file must be refused with the field it names, not loaded to fail every request."""

from __future__ import annotations

import math


def finite_number(value) -> bool:
    """A finite JSON number (not a bool): what a saved state's measured values must be."""
    return not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)


def check_count(name: str, value, least: int = 0) -> None:
    """ValueError naming ``name`` unless ``value`` is an integer >= ``least`` (not a bool)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ValueError(f"{name}: expected an integer >= {least}, got {value!r}")
