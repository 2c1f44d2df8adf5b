"""One emulated engine replica: a continuous-batching step loop on the asyncio event loop.

Each step admits waiting sequences (in arrival order, or with the priority scheduling
policy lowest `priority` first, then arrival order) while the batch has room
(`max_num_seqs`), the KV budget allows (prompt + output tokens reserved on admission) and
the step's prompt budget (`max_num_batched_tokens`; at least one sequence) lasts, sleeps for
the ground-truth step time, then gives every running sequence one token. With priority
preemption a waiting sequence that does not fit preempts running ones of a worse
(priority, arrival) (vLLM's recompute preemption: they keep their tokens, go back to the
waiting queue and prefill prompt + generated tokens again when readmitted).
A newly admitted sequence gets its first token at the end of its prefill step. Step
deadlines are absolute (`loop.time()`), so the per-step overhead of this Python code and the
scheduler's wake-up jitter do not accumulate into lower throughput than the ground truth.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
import math
import random
from collections.abc import Callable

from simulation.engine.profile import step_seconds

from .config import PRIORITY, ModelConfig
from .faults import Faults, corrupt_token
from .metrics import ModelMetrics
from .prefix_cache import PrefixCache

STARTING = "starting"
READY = "ready"
DRAINING = "draining"
STOPPED = "stopped"

FINISH_STOP = "stop"
FINISH_LENGTH = "length"
FINISH_ABORT = "abort"

# Sequence states.
PENDING = "pending"  # no ready replica yet (fleet-level queue)
WAITING = "waiting"  # queued on a replica
RUNNING = "running"
FINISHED = "finished"

# Arrival order of every sequence of the process: the tie-break after `priority`.
_ARRIVALS = itertools.count()


class Listener:
    """Wakes the one HTTP handler that owns some sequences when any of them changes.

    A bare future per wait, instead of an `asyncio.Queue` per sequence, keeps the per-token
    cost to one `set_result` however many tokens arrived since the handler last looked.
    """

    __slots__ = ("_waiter", "streaming")

    def __init__(self, *, streaming: bool) -> None:
        self._waiter: asyncio.Future[None] | None = None
        # A non-streamed request only needs waking when its sequences finish.
        self.streaming = streaming

    def wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def wait(self) -> None:
        waiter = asyncio.get_running_loop().create_future()
        self._waiter = waiter
        try:
            await waiter
        finally:
            self._waiter = None


def plan_output_tokens(
    rng: random.Random,
    *,
    mean_output_tokens: int,
    max_tokens: int,
    min_tokens: int,
    ignore_eos: bool,
) -> tuple[int, str]:
    """How many tokens a sequence will generate and why it will stop.

    Without `ignore_eos` the natural length is geometric with the model's mean (an EOS
    token is equally likely at every step), then bounded by `min_tokens` and `max_tokens`.
    """
    if ignore_eos:
        return max_tokens, FINISH_LENGTH
    if mean_output_tokens <= 1:
        natural = 1
    else:
        u = 1.0 - rng.random()  # in (0, 1]
        natural = 1 + int(math.log(u) / math.log(1.0 - 1.0 / mean_output_tokens))
    if natural >= max_tokens:
        return max_tokens, FINISH_LENGTH
    return max(natural, min_tokens, 1), FINISH_STOP


class Sequence:
    """One prompt of one request, from arrival to its last token."""

    __slots__ = (
        "request_id",
        "prompt_token_ids",
        "prompt_tokens",
        "max_tokens",
        "target_output_tokens",
        "planned_finish_reason",
        "priority",
        "rng",
        "vocab_size",
        "listener",
        "state",
        "replica",
        "output_token_ids",
        "finish_reason",
        "error",
        "arrival_seconds",
        "admitted_seconds",
        "first_token_seconds",
        "finished_seconds",
        "order",
        "num_preemptions",
        "cached_tokens",
        "image_ends",
    )

    def __init__(
        self,
        *,
        request_id: str,
        prompt_token_ids: list[int],
        max_tokens: int,
        target_output_tokens: int,
        planned_finish_reason: str,
        priority: int,
        rng: random.Random,
        vocab_size: int,
        listener: Listener,
        arrival_seconds: float,
        image_ends: tuple[int, ...] = (),
    ):
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.prompt_tokens = len(prompt_token_ids)
        self.max_tokens = max_tokens
        self.target_output_tokens = target_output_tokens
        self.planned_finish_reason = planned_finish_reason
        self.priority = priority
        self.rng = rng
        self.vocab_size = vocab_size
        self.listener = listener
        self.state = PENDING
        self.replica: Replica | None = None
        self.output_token_ids: list[int] = []
        self.finish_reason: str | None = None
        self.error: str | None = None
        self.arrival_seconds = arrival_seconds
        self.admitted_seconds: float | None = None
        self.first_token_seconds: float | None = None
        self.finished_seconds: float | None = None
        self.order = next(_ARRIVALS)
        self.num_preemptions = 0
        # Prompt tokens served from the prefix cache when it was first admitted.
        self.cached_tokens = 0
        # Where each image's placeholder tokens end in the prompt: an image whose tokens are
        # all cached needs no pass of the vision encoder.
        self.image_ends = image_ends

    @property
    def done(self) -> bool:
        return self.state == FINISHED

    @property
    def kv_reservation_tokens(self) -> int:
        # The emulator decides the EOS up front, so it can reserve exactly the KV the sequence
        # will peak at: it then never runs out of KV mid-sequence (vLLM's preemption for KV
        # pressure; only priority preemption can preempt here), and a request without
        # `max_tokens` (chat: the rest of the context) does not block a whole context's worth.
        # With ignore_eos this is prompt + max_tokens.
        return self.prompt_tokens + self.target_output_tokens

    @property
    def context_tokens(self) -> int:
        return self.prompt_tokens + len(self.output_token_ids)

    def finish(self, reason: str, now_seconds: float, metrics: ModelMetrics | None) -> None:
        self.state = FINISHED
        self.finish_reason = reason
        self.finished_seconds = now_seconds
        if metrics is not None:
            queue = prefill = decode = None
            if self.admitted_seconds is not None:
                queue = self.admitted_seconds - self.arrival_seconds
                if self.first_token_seconds is not None:
                    prefill = self.first_token_seconds - self.admitted_seconds
                    decode = now_seconds - self.first_token_seconds
            metrics.record_finished(
                finish_reason=reason,
                prompt_tokens=self.prompt_tokens,
                generation_tokens=len(self.output_token_ids),
                e2e_seconds=now_seconds - self.arrival_seconds,
                queue_seconds=queue,
                prefill_seconds=prefill,
                decode_seconds=decode,
            )
        self.listener.wake()

    def fail(self, message: str, now_seconds: float) -> None:
        """End a sequence that never reached a replica (the handler answers 503)."""
        self.error = message
        self.state = FINISHED
        self.finish_reason = FINISH_ABORT
        self.finished_seconds = now_seconds
        self.listener.wake()


async def sleep_until(loop: asyncio.AbstractEventLoop, deadline_seconds: float) -> None:
    """Sleep to an absolute `loop.time()`; `asyncio.sleep(d)` would re-read the clock."""
    if deadline_seconds <= loop.time():
        # Still yield, so a replica that is behind schedule cannot starve the HTTP handlers.
        await asyncio.sleep(0)
        return
    future = loop.create_future()
    handle = loop.call_at(deadline_seconds, _resolve, future)
    try:
        await future
    finally:
        handle.cancel()


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


class _Admitted:
    """What one step admitted: its sequences, the prompt tokens it computes (recomputed ones
    of readmitted sequences included), the new prompts' tokens and how many of them the
    prefix cache served, and the images the vision encoder runs on."""

    __slots__ = (
        "sequences",
        "computed_tokens",
        "new_prompt_tokens",
        "cached_tokens",
        "encoded_images",
    )

    def __init__(self) -> None:
        self.sequences: list[Sequence] = []
        self.computed_tokens = 0
        self.new_prompt_tokens = 0
        self.cached_tokens = 0
        self.encoded_images = 0

    @property
    def recomputed_tokens(self) -> int:
        return self.computed_tokens - (self.new_prompt_tokens - self.cached_tokens)


class Replica:
    def __init__(
        self,
        model: ModelConfig,
        replica_id: int,
        metrics: ModelMetrics | None = None,
        on_stopped: Callable[[Replica], None] | None = None,
        faults: Faults | None = None,
    ):
        self.model = model
        self.faults = faults if faults is not None else Faults()
        self._priority_policy = model.scheduling_policy == PRIORITY
        self._priority_preemption = self._priority_policy and model.priority_preemption
        self.replica_id = replica_id
        self.metrics = metrics
        self.state = STARTING
        self.running: list[Sequence] = []
        self.kv_reserved_tokens = 0
        self.context_tokens = 0  # prompt + generated tokens of the running sequences
        self.step_lag_seconds = 0.0
        self._waiting: list[tuple[int, int, Sequence]] = []
        self._waiting_count = 0
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._on_stopped = on_stopped
        # Each engine keeps its own prefix cache, as each vLLM replica does.
        self.prefix_cache = (
            PrefixCache(block_size=model.block_size, capacity_blocks=model.prefix_cache_blocks)
            if model.enable_prefix_caching
            else None
        )

    # -- state seen by the fleet ----------------------------------------------------------

    @property
    def waiting_count(self) -> int:
        return self._waiting_count

    @property
    def load(self) -> int:
        return len(self.running) + self._waiting_count

    def start(self) -> None:
        self.state = READY
        self._task = asyncio.get_running_loop().create_task(
            self._run(), name=f"replica-{self.model.name}-{self.replica_id}"
        )

    def drain(self) -> None:
        """Stop taking new sequences; finish the ones it has, then stop."""
        self.state = DRAINING
        self._wake.set()

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self.state = STOPPED

    def submit(self, seq: Sequence) -> None:
        seq.replica = self
        self._enqueue(seq)
        self._wake.set()

    def _enqueue(self, seq: Sequence) -> None:
        seq.state = WAITING
        # fcfs ignores `priority` (a non-zero one is refused at the door, as by vLLM); a
        # preempted sequence keeps its arrival order.
        key = seq.priority if self._priority_policy else 0
        heapq.heappush(self._waiting, (key, seq.order, seq))
        self._waiting_count += 1

    def abort(self, seq: Sequence, now_seconds: float) -> None:
        if seq.state == WAITING:
            # Left in the heap and skipped when popped: removal from a heap is O(n).
            self._waiting_count -= 1
        elif seq.state == RUNNING:
            self.running.remove(seq)
            self._release(seq)
        else:
            return
        seq.finish(FINISH_ABORT, now_seconds, self.metrics)

    # -- the step loop --------------------------------------------------------------------

    def _release(self, seq: Sequence) -> None:
        self.kv_reserved_tokens -= seq.kv_reservation_tokens
        self.context_tokens -= seq.context_tokens

    def _fits(self, seq: Sequence) -> bool:
        return (
            len(self.running) < self.model.max_num_seqs
            and self.kv_reserved_tokens + seq.kv_reservation_tokens <= self.model.kv_cache_tokens
        )

    def _admit(self, now_seconds: float) -> _Admitted:
        """Admit what fits; returns what the step prefills.

        A readmitted (preempted) sequence prefills its prompt and its generated tokens again;
        a new one prefills what the prefix cache does not hold of its prompt.
        """
        step = _Admitted()
        model = self.model
        cache = self.prefix_cache
        while self._waiting:
            _key, _order, seq = self._waiting[0]
            if seq.state != WAITING:
                heapq.heappop(self._waiting)
                continue
            new = not seq.output_token_ids and seq.num_preemptions == 0
            hits = cache.hit_tokens(seq.prompt_token_ids) if new and cache is not None else 0
            tokens = seq.context_tokens - hits
            # The step's prompt budget counts the tokens to compute, as vLLM's token budget
            # does; a prompt larger than the budget goes alone (vLLM would chunk it over
            # several steps, which costs the same prefill time).
            if step.sequences and step.computed_tokens + tokens > model.max_num_batched_tokens:
                break
            # Strict order: a large head-of-line request is not overtaken by smaller ones,
            # as in vLLM, so priority means what it says.
            if not self._fits(seq):
                if self._priority_preemption and self._preempt_one_for(seq):
                    continue
                break
            step.computed_tokens += tokens
            if new:
                step.new_prompt_tokens += seq.prompt_tokens
                step.cached_tokens += hits
                step.encoded_images += sum(1 for end in seq.image_ends if end > hits)
                seq.cached_tokens = hits
                if cache is not None:
                    cache.admit(seq.prompt_token_ids)
                    if self.metrics is not None:
                        self.metrics.record_prefix_cache(
                            queried_tokens=seq.prompt_tokens, hit_tokens=hits
                        )
            heapq.heappop(self._waiting)
            self._waiting_count -= 1
            seq.state = RUNNING
            if seq.admitted_seconds is None:
                seq.admitted_seconds = now_seconds
            self.running.append(seq)
            self.kv_reserved_tokens += seq.kv_reservation_tokens
            self.context_tokens += seq.context_tokens
            step.sequences.append(seq)
        return step

    def _preempt_one_for(self, seq: Sequence) -> bool:
        """Preempt the running sequence that comes last in (priority, arrival) order if it
        comes after `seq` (vLLM V0's `_schedule_priority_preemption`, recompute mode).

        Everything admitted in this step comes before `seq` (the waiting queue is popped in
        order), so a victim is always one that ran in an earlier step.
        """
        if not self.running:
            return False
        victim = max(self.running, key=lambda s: (s.priority, s.order))
        if (victim.priority, victim.order) <= (seq.priority, seq.order):
            return False
        self.running.remove(victim)
        self._release(victim)
        victim.num_preemptions += 1
        self._enqueue(victim)
        if self.metrics is not None:
            self.metrics.record_preemption()
        return True

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        model = self.model
        deadline_seconds: float | None = None
        last_emit_seconds = 0.0
        faults = self.faults
        try:
            while True:
                if not self.running and self._waiting_count == 0:
                    if self.state == DRAINING:
                        break
                    self._wake.clear()
                    await self._wake.wait()
                    deadline_seconds = None  # idle: the next step starts when work arrives
                    continue
                if faults.hanging:
                    # An injected hang: no step, no token, until the fault changes.
                    await faults.changed()
                    deadline_seconds = None
                    continue
                now_seconds = loop.time()
                step_start_seconds = now_seconds if deadline_seconds is None else deadline_seconds
                self.step_lag_seconds = max(0.0, now_seconds - step_start_seconds)
                step = self._admit(now_seconds)
                if not self.running:
                    continue
                deadline_seconds = step_start_seconds + faults.slow_factor * step_seconds(
                    model,
                    prefill_tokens=step.computed_tokens,
                    cached_tokens=step.cached_tokens,
                    encoded_images=step.encoded_images,
                    running_sequences=len(self.running),
                    context_tokens=self.context_tokens,
                )
                await sleep_until(loop, deadline_seconds)
                now_seconds = loop.time()
                self._emit(now_seconds, step, now_seconds - last_emit_seconds)
                last_emit_seconds = now_seconds
        finally:
            self.state = STOPPED
            if self._on_stopped is not None:
                self._on_stopped(self)

    def _emit(self, now_seconds: float, step: _Admitted, since_last_emit_seconds: float) -> None:
        ttfts_seconds = []
        finished = False
        wrong_output = self.faults.wrong_output
        for seq in self.running:
            out = seq.output_token_ids
            if not out:
                seq.first_token_seconds = now_seconds
                ttfts_seconds.append(now_seconds - seq.arrival_seconds)
            token_id = seq.rng.randrange(seq.vocab_size)
            if wrong_output:
                # Drawn all the same, so the right tokens resume when the fault clears.
                token_id = corrupt_token(token_id, seq.vocab_size)
            out.append(token_id)
            if len(out) >= seq.target_output_tokens:
                finished = True  # finish() wakes the listener
            elif seq.listener.streaming:
                seq.listener.wake()
        generated = len(self.running)
        self.context_tokens += generated
        if self.metrics is not None:
            # Every sequence that was already running got its previous token at the end of
            # the previous step, so they all share one inter-token latency.
            self.metrics.record_step(
                prefill_tokens=step.new_prompt_tokens,
                cached_tokens=step.cached_tokens,
                recomputed_tokens=step.recomputed_tokens,
                generated_tokens=generated,
                first_token_ttfts_seconds=ttfts_seconds,
                inter_token_latency_seconds=since_last_emit_seconds,
                continuing_tokens=generated - len(ttfts_seconds),
            )
        if finished:
            still_running = []
            for seq in self.running:
                if len(seq.output_token_ids) >= seq.target_output_tokens:
                    self._release(seq)
                    seq.finish(seq.planned_finish_reason, now_seconds, self.metrics)
                else:
                    still_running.append(seq)
            self.running = still_running
