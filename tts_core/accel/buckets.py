"""Shape buckets: a captured graph exists per bucket size, and live work is padded up to one."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

SolveKey = tuple[int, int, int]  # a batched flow solve's bucket: (rows, context frames, new frames)


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


def solve_cost(key: SolveKey) -> int:
    """A solve bucket's work, in row-frames: rows x (context + new frames)."""
    rows, ctx, new = key
    return rows * (ctx + new)


def solve_keys_largest_first(rows: Iterable[int], ctx_caps: Iterable[int], new_caps: Iterable[int]) -> list[SolveKey]:
    """Every (rows, ctx_cap, new_cap) bucket, the costliest first: captured in this order, later graphs reuse
    the first one's blocks of their shared memory pool (the first holds the most of everything)."""
    ctx_caps, new_caps = list(ctx_caps), list(new_caps)
    return sorted(((r, c, n) for r in rows for c in ctx_caps for n in new_caps),
                  key=lambda k: (solve_cost(k), k), reverse=True)


def smallest_solve_bucket(keys: Iterable[SolveKey], rows: int, ctx: int, new: int) -> SolveKey | None:
    """The cheapest bucket a call of `rows` rows, `ctx` context and `new` new frames fits (fewer rows first
    among equal costs); None if it fits none (the caller runs it eagerly)."""
    fits = [k for k in keys if k[0] >= rows and k[1] >= ctx and k[2] >= new]
    return min(fits, key=lambda k: (solve_cost(k), k[0])) if fits else None
