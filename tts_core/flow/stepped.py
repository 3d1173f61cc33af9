"""Euler steps over rows that join and leave at any step: the first chunks of new calls, batched.

A first chunk rendered in a call of its own is ten Euler steps of about a thousand small kernels at
one row, launch-bound; beside the decode step and the later chunks it takes about twice as long as
alone, and first chunks rendered that way were half the GPU's kernel time at 13 new calls a second
(docs/PERF_NOTES.md, 2026-11-24). Here one loop steps every first chunk in flight at once, each row
at its own step: a row joins at the next step boundary and leaves after its last step, so the
kernels of concurrent first chunks are shared. Measured on the H100 (PERF_NOTES, 2026-11-24
morning): about a fifth less kernel time per first chunk, but under load a step slows with the
rows in it and a row waits for ten, so first chunks were no sooner (`step_first_chunks` is off).

Each row reads and writes its own step's share of the pool (`CallIndex.at_step` with a step per
row), so ten steps give a row exactly what `pooled_solve` gives it (tests/tts_core/test_flow_stepped.py).

Row state lives in static device buffers of `rows + 1` rows (the last is a permanent padding row):
each row's solve inputs (made as it joins), x and its step. A step runs on the first `bucket` rows
(padding rows read nothing and write only to the pool's trash); rows that leave are compacted away
on the device. `runners` may replace a bucket's eager step by a graph replay
(accel/flow_pool_graphs). One thread drives a `SteppedFlow`.
"""
from __future__ import annotations

import bisect
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from tts_core.flow.context_pool import CallIndex
from tts_core.flow.pooled import (
    PooledFlow,
    PooledPlan,
    PooledStream,
    SolveInputs,
    StepTables,
    aligned_mask_buffer,
    pooled_row_step,
    solve_inputs,
)
from tts_core.host_copy import to_device


@dataclass
class SteppedRow:
    key: object  # the caller's, returned with the row's mel
    stream: PooledStream
    plan: PooledPlan
    steps_done: int = 0
    joined_at: float = field(default_factory=time.perf_counter)


def _parts(inputs: SolveInputs) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """`inputs`' tensors by name, rows on one axis: (B, ...) ones, and [conditioned |
    unconditioned] ones as (2, B, ...) (views where the layout allows). The attention mask is padded
    to its 16-aligned rows (additive_mask), so that a step's slice of it keeps them."""
    b, index = inputs.x0.size(0), inputs.index
    keys = index.key_pos.size(1)
    padded = aligned_mask_buffer(inputs.attn.shape[:-1], keys, inputs.attn.dtype, inputs.attn.device)
    padded[..., :keys] = inputs.attn

    def halves(t: torch.Tensor) -> torch.Tensor:
        return t.reshape(2, b, *t.shape[1:])

    return ({"x0": inputs.x0, "key_pos": index.key_pos, "new_pos": index.new_pos},
            {"mu": halves(inputs.mu), "cond": halves(inputs.cond), "spks": halves(inputs.spks),
             "attn": halves(padded), "ctx_frames": index.ctx_frames, "write_frames": index.write_frames,
             "left_src": index.left_src, "left_dst": index.left_dst,
             **{f"conv_at_{n}": halves(at) for n, at in index.conv_at.items()}})


class _RowInputs:
    """`SolveInputs` of every row of a `SteppedFlow`, kept on the device between steps (made once as
    a row joins instead of in every step: ~100 small kernels a step less). Each tensor keeps its
    rows on one axis: (B, ...) tensors on axis 0, [conditioned | unconditioned] ones as (2, B, ...)."""

    def __init__(self, inputs: SolveInputs) -> None:
        self.keys = inputs.index.key_pos.size(1)
        self.conv_widths = sorted(inputs.index.conv_at)
        rows, halves = _parts(inputs)
        self.rows = {name: t.clone() for name, t in rows.items()}
        self.halves = {name: t.clone() for name, t in halves.items()}

    def put(self, row: int, one: SolveInputs) -> None:
        """Row `row` becomes the one row of `one`."""
        rows, halves = _parts(one)
        for name, t in self.rows.items():
            t[row].copy_(rows[name][0])
        for name, t in self.halves.items():
            t[:, row].copy_(halves[name][:, 0])

    def reorder(self, order: torch.Tensor) -> None:
        """Row i becomes row order[i] (device long tensor of every row)."""
        for t in self.rows.values():
            t.copy_(t.index_select(0, order))
        for t in self.halves.values():
            t.copy_(t.index_select(1, order))

    def take(self, b: int) -> SolveInputs:
        """Rows [0, b) as `solve_inputs` would make them (capturable)."""
        r, h = self.rows, self.halves

        def stacked(name: str) -> torch.Tensor:
            t = h[name][:, :b]
            return t.reshape(2 * b, *t.shape[2:])

        index = CallIndex(ctx_frames=h["ctx_frames"][:, :b], key_pos=r["key_pos"][:b], new_pos=r["new_pos"][:b],
                          write_frames=h["write_frames"][:, :b], left_src=h["left_src"][:, :b],
                          left_dst=h["left_dst"][:, :b],
                          conv_at={n: stacked(f"conv_at_{n}") for n in self.conv_widths})
        return SolveInputs(index, r["x0"][:b], stacked("mu"), stacked("cond"), stacked("spks"),
                           stacked("attn")[..., :self.keys])


class SteppedFlow:
    def __init__(self, pooled: PooledFlow, rows: int, ctx_cap: int, new_cap: int,
                 estimator: Callable | None = None) -> None:
        self.pooled = pooled
        self.capacity, self.ctx_cap, self.new_cap = rows, ctx_cap, new_cap
        self.estimator = estimator
        self.tables = StepTables.of(pooled.steps)
        dev, mel = pooled.device, pooled.model.cfg.output_size
        with torch.inference_mode():
            self.inputs = _RowInputs(self._solve_inputs([pooled.padding_row()] * (rows + 1),
                                                        torch.zeros(rows + 1, mel, new_cap, device=dev,
                                                                    dtype=pooled.dtype)))
        self.x = torch.zeros(rows + 1, mel, new_cap, device=dev, dtype=pooled.dtype)
        self.row_steps = torch.zeros(rows + 1, dtype=torch.long, device=dev)
        self.rows: list[SteppedRow] = []
        self.runners: dict[int, Callable[[], None]] = {}  # bucket -> one step over rows [0, bucket)
        self._launched: torch.cuda.Event | None = None  # the end of the step before the last (CUDA)

    # ---- host side -----------------------------------------------------------------------------
    @property
    def free(self) -> int:
        return self.capacity - len(self.rows)

    def fits(self, plan: PooledPlan) -> bool:
        return plan.new_frames <= self.new_cap and plan.ctx_frames <= self.ctx_cap

    @torch.inference_mode()
    def join(self, key: object, stream: PooledStream, plan: PooledPlan, mu: torch.Tensor) -> None:
        """Add a row (it takes its first step with the next `step`): mu (80, n) for the plan's new frames."""
        if not self.free or not self.fits(plan):
            raise ValueError(f"stepped flow: no room for a row of {plan.new_frames} new frames "
                             f"({len(self.rows)}/{self.capacity} rows, new cap {self.new_cap})")
        i = len(self.rows)
        padded = torch.zeros(1, mu.size(0), self.new_cap, device=mu.device, dtype=mu.dtype)
        padded[0, :, :mu.size(1)] = mu
        self.inputs.put(i, self._solve_inputs([plan.row], padded))
        self.row_steps[i].zero_()
        self.rows.append(SteppedRow(key, stream, plan))

    def _solve_inputs(self, rows: list[tuple[int, ...]], mu: torch.Tensor) -> SolveInputs:
        pooled = self.pooled
        table = to_device(rows, torch.long, pooled.device)
        return solve_inputs(pooled.model, pooled.pool, table, mu, self.ctx_cap)

    @torch.inference_mode()
    def drop(self, gone: Callable[[object], bool]) -> list[SteppedRow]:
        """Take out the rows whose key `gone` names (their streams stay open: their owners close
        them); returns them. Before the slot of a stream that left is reused: a row keeps writing
        its stream's frames until it leaves."""
        keep = [i for i, row in enumerate(self.rows) if not gone(row.key)]
        if len(keep) == len(self.rows):
            return []
        dropped = [row for row in self.rows if gone(row.key)]
        self.rows = [self.rows[i] for i in keep]
        self._compact(keep)
        return dropped

    @torch.inference_mode()
    def step(self) -> list[tuple[SteppedRow, torch.Tensor]]:
        """One Euler step of every row; the rows that took their last one leave, each with its mel
        (1, 80, new frames) float32 (not yet `PooledFlow.finish`ed)."""
        if not self.rows:
            return []
        buckets = sorted(self.runners)
        at = bisect.bisect_left(buckets, len(self.rows))
        if at < len(buckets):
            self.runners[buckets[at]]()
        else:
            self.advance(len(self.rows))
        self._pace()
        for row in self.rows:
            row.steps_done += 1
        steps = self.tables.steps
        if all(row.steps_done < steps for row in self.rows):
            return []
        done = [(row, self.x[i:i + 1, :, :row.plan.new_frames].to(torch.float32, copy=True))
                for i, row in enumerate(self.rows) if row.steps_done == steps]
        keep = [i for i, row in enumerate(self.rows) if row.steps_done < steps]
        self.rows = [self.rows[i] for i in keep]
        self._compact(keep)
        return done

    def _pace(self) -> None:
        """Let the host run at most one step ahead of the GPU: a row that joins waits for the steps
        already queued before its first, so that queue is kept short."""
        if self.pooled.device.type != "cuda":
            return
        previous, self._launched = self._launched, torch.cuda.Event()
        self._launched.record()
        if previous is not None:
            previous.synchronize()

    def _compact(self, keep: list[int]) -> None:
        """Rows `keep` move to the front in order; every other row becomes the padding row."""
        order = to_device(keep + [self.capacity] * (self.capacity + 1 - len(keep)), torch.long, self.pooled.device)
        self.inputs.reorder(order)
        for buf in (self.x, self.row_steps):
            buf.copy_(buf.index_select(0, order))

    # ---- device side (capturable) ---------------------------------------------------------------
    def advance(self, rows: int) -> None:
        """One step of rows [0, rows): x and each row's step move on in place. A padding row's step
        wraps around: any number of steps (a graph's warm-up and capture included) stays a valid
        step index, and its values stay finite (they go to the pool's trash frame, which other
        rows' padding keys read: masked, but 0 x NaN would still be NaN)."""
        pooled = self.pooled
        step = self.row_steps[:rows]
        x = pooled_row_step(pooled.model, pooled.pool, self.inputs.take(rows), self.x[:rows], step, self.tables,
                            self.estimator)
        self.x[:rows].copy_(x)
        step.copy_((step + 1) % self.tables.steps)
