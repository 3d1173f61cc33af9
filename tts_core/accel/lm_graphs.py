"""CUDA-graph replay of the speech LM's decode step and draw, for continuous batching, and of its
prefill.

One decode step of the 0.5B LM is ~350 small kernels; launched eagerly the CPU, not the GPU, sets
the pace (tens of ms per step). `GraphedDecoder` captures the step and the batched RAS draw once per
(batch bucket, attend bucket) and replays the smallest one that fits; the rest of the bucket points
at a reserved scratch slot, whose cache row absorbs the padding writes and is reset inside the graph
every step (so its position never runs off the cache). `attend_len` buckets bound how many cache
columns attention reads: the caller passes `kv_len` (the longest live slot's length before the
step) and the smallest attend bucket > kv_len is chosen.

Each slot's input token and RAS window stay on the device (`carried_decode.SlotTokens`): `seed`
sets a slot's state when its segment starts, `launch` replays a step for some slots and returns
their tokens as `PendingTokens`, copied to the host behind the step, so the caller can launch the
next step before reading them (tts_core/accel/carried_decode.py; `EagerCarriedDecoder` is the same
contract without graphs).

With `compile=True` the step is first fused by torch.compile (inductor, dynamic batch) inside the
warm-up before capture, so the cost lands in the constructor and never on a first step (H100 bf16:
15 s with a warm compiler cache, ~1 minute cold; a step 2.7-5.5 ms -> 1.3-2.4 ms at batch 1-128,
bench/bench_decode.py). The runtime captures the eager step first (a second or two) and the compiled
one on another thread while serving (`capture_compiled`; swapped in at a step's launch, `GraphSwap`). The
projections are fused too (`fuse=True`: one q/k/v and one gate/up matmul per layer; the LM's
state-dict keys are unchanged). The scratch slot belongs to this runner; the scheduler must never
assign it to a request.

`GraphedPrefill` does the same for `SpeechTokenLM.prefill` of one request, per input-length bucket.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Sequence
from dataclasses import dataclass

import structlog
import torch

from tts_core.accel import decode_attention
from tts_core.accel.batched_sampler import BatchedRasSampler
from tts_core.accel.buckets import power_of_two_buckets, select_bucket
from tts_core.accel.carried_decode import PendingTokens, SlotTokens, draw_first
from tts_core.accel.graph_capture import charge, upload
from tts_core.accel.graph_swap import GraphSwap
from tts_core.llm.speech_lm import SpeechTokenLM

log = structlog.get_logger(__name__)

# The undecorated step (SpeechTokenLM.decode_step minus its inference_mode wrapper), for compiling.
_decode_step = SpeechTokenLM.decode_step.__wrapped__  # type: ignore[attr-defined]


HOST_BUFFERS = 3  # carried launches whose pinned host buffers rotate (see GraphedDecoder.__init__)


@dataclass(frozen=True)
class _DecodeSet:
    """One generation of the decoder's graphs (`GraphSwap`): its row inputs, its graphs by
    (batch, attend) bucket with their outputs (logp, drawn), the generator they draw from."""

    inputs: torch.Tensor
    graphs: dict
    generator: torch.Generator
    compiled: bool


class GraphedDecoder:
    def __init__(self, lm: SpeechTokenLM, sampler: BatchedRasSampler, batch_buckets: Sequence[int] | None = None,
                 attend_buckets: Sequence[int] | None = None, scratch_slot: int | None = None,
                 compile: bool = True, warmup: int = 2, fuse: bool = True, slot_attention: bool = True) -> None:
        cache = lm.kv_cache
        if cache is None:
            raise RuntimeError("GraphedDecoder: call lm.setup_cache(max_batch, max_len) first")
        if cache.device.type != "cuda":
            raise RuntimeError("GraphedDecoder needs the model and its cache on a CUDA device")
        self.lm = lm
        self.cache = cache
        self.scratch_slot = cache.max_batch - 1 if scratch_slot is None else scratch_slot
        usable = cache.max_batch - 1  # every slot but the scratch one may be live
        self.batch_buckets = tuple(sorted(batch_buckets or power_of_two_buckets(usable)))
        self.attend_buckets = tuple(sorted(attend_buckets or (cache.max_len,)))
        if self.batch_buckets[-1] > usable:
            raise ValueError(f"GraphedDecoder: bucket {self.batch_buckets[-1]} exceeds the {usable} usable slots")
        if self.attend_buckets[-1] > cache.max_len:
            raise ValueError(f"GraphedDecoder: attend bucket {self.attend_buckets[-1]} exceeds the cache length")
        device = cache.device
        largest = self.batch_buckets[-1]
        self.sampler = sampler
        self.state = SlotTokens(cache.max_batch, sampler.config.win_size, device)
        # Pinned host buffers, used in turn: the inputs of a launch and its drawn tokens. A buffer
        # is written again HOST_BUFFERS launches later; by then the caller has read that step (it
        # keeps at most HOST_BUFFERS - 1 steps unread when it launches), so its copies are done.
        self._host_inputs = [torch.empty((2, largest), dtype=torch.long).pin_memory() for _ in range(HOST_BUFFERS)]
        self._host_tokens = [torch.empty(largest, dtype=torch.long).pin_memory() for _ in range(HOST_BUFFERS)]
        # Their steps' done events, in turn with the buffers: made once, recorded again and again.
        # Under load a new CUDA event took up to 71 ms to make and record beside the render lanes'
        # graph launches (bench/host_waits.py), and the decode thread makes one per step.
        self._step_events = [torch.cuda.Event() for _ in range(HOST_BUFFERS)]
        self._turn = 0
        # First draws run eagerly, on the prefill stream: a generator apart from the graphs' (below),
        # so the two kinds of draws do not depend on each other's order.
        self._first_generator = torch.Generator(device=device).manual_seed(0)
        if fuse:
            lm.fuse_projections()
        # One kernel per layer rotates q/k, writes the step's keys/values and reads each row's own
        # cache columns by slot, instead of gathering all `attend` columns of every row for SDPA
        # (accel/decode_attention.py).
        self.slot_attention = slot_attention and decode_attention.available()
        cache.decode_attention = decode_attention.decode_attention if self.slot_attention else None
        self._warmup = warmup
        started = time.perf_counter()
        # Compiling happens here, in the warm-up before capture: never on a caller's first step.
        self._sets = GraphSwap(self._capture_set(compile, restore=True), "decode")
        self.capture_seconds = time.perf_counter() - started
        log.info("lm_decode_graphs_captured", buckets=len(self._sets.current.graphs), compiled=compile, fused=fuse,
                 slot_attention=self.slot_attention, seconds=round(self.capture_seconds, 1))

    @property
    def generator(self) -> torch.Generator:
        """The current graphs' draws come from it (seed it to repeat a run's draws)."""
        return self._sets.current.generator

    @property
    def compiled(self) -> bool:
        return self._sets.current.compiled

    def capture_compiled(self) -> None:
        """Another thread, while this decoder serves: compile the step and record a compiled graph
        set, published for the decode thread's next `launch` (`GraphSwap`). Touches only the
        scratch slot's cache row, length and carried state, as every padding row does."""
        self._sets.publish(self._capture_set(True, restore=False))

    def _capture_set(self, compile: bool, restore: bool) -> _DecodeSet:
        device = self.cache.device
        largest = self.batch_buckets[-1]
        # Row inputs: the slots, then whether each row may stop; one host copy per step. Each set
        # has its own: a set's warm-up runs (all rows on the scratch slot) must not read the slots
        # the decode thread writes for the set it replays.
        inputs = torch.full((2, largest), self.scratch_slot, dtype=torch.long, device=device)
        # The graphs' draws come from a generator of their own, registered with each graph: only the
        # thread stepping this decoder replays them, so no other thread's replay races on its
        # offset (graph_capture).
        generator = torch.Generator(device=device)
        generator.seed()
        step = torch.compile(_decode_step, dynamic=True) if compile else _decode_step
        graphs = self._capture_all(functools.partial(self._step, inputs, generator, step), generator, restore)
        return _DecodeSet(inputs, graphs, generator, compile)

    def _step(self, inputs: torch.Tensor, generator: torch.Generator, decode, batch: int,
              attend: int) -> tuple[torch.Tensor, torch.Tensor]:
        # Reset inside the graph: padding rows advance the scratch slot every replay.
        # A slice fill, not `lengths[i] = 0`: the latter copies a host scalar, which capture forbids.
        self.cache.lengths.narrow(0, self.scratch_slot, 1).zero_()
        slots = inputs[0, :batch]
        tokens, history = self.state.gather(slots)
        logp = decode(self.lm, slots, tokens, attend_len=attend)
        drawn = self.sampler.sample(logp, history, inputs[1, :batch] != 0, generator)
        self.state.advance(slots, history, drawn)
        return logp, drawn

    @torch.inference_mode()
    def _capture_all(self, step, generator: torch.Generator, restore: bool) -> dict:
        """`restore`: put the cache lengths and carried state back afterwards (at start-up; a
        capture beside serving must not: those rows are live, and it touched only the scratch's)."""
        pool = torch.cuda.graph_pool_handle()
        saved = self.cache.lengths.clone() if restore else None
        saved_state = (self.state.last.clone(), self.state.history.clone()) if restore else None
        # Warm up and capture on a stream of the decoder's own (cuBLAS handles, workspace: see
        # graph_capture.capture_graph) with every row on the scratch slot.
        side = torch.cuda.Stream()
        started = time.perf_counter()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for batch in self.batch_buckets:
                for attend in self.attend_buckets:
                    for _ in range(self._warmup):
                        step(batch, attend)
        torch.cuda.current_stream().wait_stream(side)
        side.synchronize()
        recording = time.perf_counter()
        graphs = {}
        # Largest first, so smaller graphs reuse the pool's blocks.
        for batch in reversed(self.batch_buckets):
            for attend in reversed(self.attend_buckets):
                graph = torch.cuda.CUDAGraph()
                graph.register_generator_state(generator)
                # Thread-local: the serving threads' syncs must not break a capture beside them.
                with torch.cuda.graph(graph, pool=pool, stream=side, capture_error_mode="thread_local"):
                    out = step(batch, attend)
                upload(graph, side)
                graphs[(batch, attend)] = (graph, out)
        side.synchronize()  # the uploads are done before the decode stream replays the graphs
        charge(started, recording, len(graphs))
        if restore:
            self.cache.lengths.copy_(saved)
            self.state.last.copy_(saved_state[0])
            self.state.history.copy_(saved_state[1])
        return graphs

    def _current(self) -> _DecodeSet:
        """The swap point (decode thread): a published set replaces the current one here, after the
        steps in flight on this thread's stream, which replay the old set's graphs, are done."""
        return self._sets.take(lambda old: torch.cuda.current_stream().synchronize())

    def bucket(self, live: int, kv_len: int | None = None) -> tuple[int, int]:
        """(batch bucket, attend bucket) a step of `live` rows whose longest slot holds `kv_len`
        positions would replay."""
        attend = self.attend_buckets[-1] if kv_len is None else select_bucket(kv_len + 1, self.attend_buckets)
        return select_bucket(live, self.batch_buckets), attend

    def seed(self, slots: Sequence[int], tokens: Sequence[Sequence[int]]) -> None:
        """Set the slots' input token and RAS window from their tokens so far."""
        self.state.seed(slots, tokens)

    @torch.inference_mode()
    def launch(self, slots: Sequence[int], allow_stop: Sequence[bool], kv_len: int | None = None) -> PendingTokens:
        """One decode step and draw for `slots` (each from its carried state), whether each row may
        draw a stop token; returns the drawn tokens, copied to the host behind the step."""
        live = len(slots)
        batch, attend = self.bucket(live, kv_len)
        host = self._host_inputs[self._turn]
        host[0, :live] = torch.as_tensor(list(slots), dtype=torch.long)
        host[0, live:batch] = self.scratch_slot
        host[1, :live] = torch.as_tensor(list(allow_stop), dtype=torch.long)
        graphs = self._current()
        graphs.inputs[:, :batch].copy_(host[:, :batch], non_blocking=True)
        graph, out = graphs.graphs[(batch, attend)]
        graph.replay()
        tokens = self._host_tokens[self._turn]
        tokens[:live].copy_(out[1][:live], non_blocking=True)
        event = self._step_events[self._turn]
        event.record()
        self._turn = (self._turn + 1) % HOST_BUFFERS
        return PendingTokens(tokens, live, event)

    @torch.inference_mode()
    def step(self, slots: torch.Tensor | Sequence[int], tokens: torch.Tensor | Sequence[int],
             kv_len: int | None = None) -> torch.Tensor:
        """Parity tests and benchmarks: one replay with `tokens` (one per slot) as the rows' inputs;
        returns logp (B, V) — a view valid until the next step. The draw advances the slots'
        carried state as `launch` does."""
        device = self.cache.device
        slots = torch.as_tensor(slots, dtype=torch.long).to(device, non_blocking=True)
        tokens = torch.as_tensor(tokens, dtype=torch.long).to(device, non_blocking=True)
        live = slots.numel()
        batch, attend = self.bucket(live, kv_len)
        self.state.last.index_copy_(0, slots, tokens)
        graphs = self._current()
        graphs.inputs[0, :live].copy_(slots)
        graphs.inputs[0, live:batch].fill_(self.scratch_slot)
        graphs.inputs[1, :batch].fill_(1)
        graph, out = graphs.graphs[(batch, attend)]
        graph.replay()
        return out[0][:live]

    def draw_first(self, slots: Sequence[int], logp: torch.Tensor, allow_stop: Sequence[bool]) -> PendingTokens:
        """Each slot's first token from its prefill's logp, drawn on the current stream; it becomes
        the slot's carried state (see carried_decode.draw_first)."""
        return draw_first(self.state, self.sampler, logp, slots, allow_stop, self._first_generator)


class GraphedPrefill:
    """`SpeechTokenLM.prefill` of one request, replayed per input-length bucket.

    The request's lm_input (T, D) is right-padded to the bucket; padding positions write cache
    columns past the request's length, which stay masked and are overwritten by its decode steps."""

    def __init__(self, lm: SpeechTokenLM, length_buckets: Sequence[int], warmup: int = 2) -> None:
        cache = lm.kv_cache
        if cache is None or cache.device.type != "cuda":
            raise RuntimeError("GraphedPrefill needs lm.setup_cache(...) on a CUDA device first")
        self.lm = lm
        self.cache = cache
        self.length_buckets = tuple(sorted(length_buckets))
        if self.length_buckets[-1] > cache.max_len:
            raise ValueError(f"GraphedPrefill: bucket {self.length_buckets[-1]} exceeds the cache length")
        device = cache.device
        width = lm.llm.config.hidden_size
        self._embeds = torch.zeros(1, self.length_buckets[-1], width, dtype=lm.llm_decoder.weight.dtype, device=device)
        self._slot = torch.zeros(1, dtype=torch.long, device=device)
        self._length = torch.ones(1, dtype=torch.long, device=device)
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._capture_all(warmup)

    def _prefill(self, length: int) -> torch.Tensor:
        embeds = self._embeds[:, :length]
        positions = torch.arange(length, device=embeds.device)[None]
        hidden = self.lm.llm(embeds, self.cache, self._slot, positions, length)
        self.cache.lengths.index_copy_(0, self._slot, self._length)
        last = hidden[0].index_select(0, self._length - 1)
        return self.lm._logp(last)

    @torch.inference_mode()
    def _capture_all(self, warmup: int) -> None:
        saved = self.cache.lengths.clone()
        pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream()
        started = time.perf_counter()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for length in self.length_buckets:
                for _ in range(warmup):
                    self._prefill(length)
        torch.cuda.current_stream().wait_stream(side)
        side.synchronize()
        recording = time.perf_counter()
        for length in reversed(self.length_buckets):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, stream=side):
                out = self._prefill(length)
            upload(graph, side)
            self._graphs[length] = (graph, out)
        side.synchronize()
        charge(started, recording, len(self._graphs))
        self.cache.lengths.copy_(saved)

    def fits(self, length: int) -> bool:
        """Whether an LM input of `length` positions has a captured bucket."""
        return length <= self.length_buckets[-1]

    @torch.inference_mode()
    def prefill(self, slot: int, lm_input: torch.Tensor) -> torch.Tensor:
        """Start a request in cache row `slot` from its lm_input (T, D); returns logp (1, V) — a view
        valid until the next prefill. Overwrites the whole of that row's first bucket columns."""
        length = lm_input.shape[0]
        bucket = select_bucket(length, self.length_buckets)
        self._embeds[0, :length].copy_(lm_input)
        self._slot.fill_(slot)
        self._length.fill_(length)
        graph, out = self._graphs[bucket]
        graph.replay()
        return out
