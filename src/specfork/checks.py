"""Value checks every layer shares: what counts as a whole number or a number.

Python's `bool` is a subclass of `int`, so `isinstance(True, int)` holds; a user's `true` where a
count belongs is a mistake to name, not the number 1.
"""

from __future__ import annotations


def is_int(x: object) -> bool:
    """An int (of Python's own kind), not a bool."""
    return isinstance(x, int) and not isinstance(x, bool)


def is_number(x: object) -> bool:
    """An int or a float, not a bool (NaN and infinities included: check them where it
    matters)."""
    return isinstance(x, int | float) and not isinstance(x, bool)
