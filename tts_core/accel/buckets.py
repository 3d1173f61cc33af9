"""Shape buckets: a captured graph exists per bucket size, and live work is padded up to one."""

from __future__ import annotations

from collections.abc import Sequence


def select_bucket(size: int, buckets: Sequence[int]) -> int:
    """The smallest bucket >= `size` (buckets in any order). Raises if `size` exceeds them all,
    because silently truncating a batch would drop requests."""
    if size <= 0:
        raise ValueError(f"bucket: size must be positive, got {size}")
    fitting = [b for b in buckets if b >= size]
    if not fitting:
        raise ValueError(f"bucket: {size} exceeds the largest bucket {max(buckets)}")
    return min(fitting)


def power_of_two_buckets(largest: int) -> tuple[int, ...]:
    """1, 2, 4, ... up to and including `largest` (which need not be a power of two)."""
    out = []
    b = 1
    while b < largest:
        out.append(b)
        b *= 2
    out.append(largest)
    return tuple(out)
