"""Per-model sets of replicas: routing, scaling with cold start, draining.

A request goes to the least-loaded ready replica (running + waiting). When a model has no
ready replica (scaled to zero, or its replicas still cold-starting) requests queue at the
model, in priority order, and count in `vllm:num_requests_waiting`, which is the signal a
control plane scales up on; they are answered 503 after `pending_timeout_seconds`.
"""

from __future__ import annotations

import asyncio
import hashlib
import heapq
import itertools
import random
import struct
from collections.abc import Callable
from typing import TypedDict

from .config import MAX_REPLICAS, PRIORITY, EmulatorConfig, ModelConfig
from .engine import (
    DRAINING,
    FINISH_ABORT,
    PENDING,
    READY,
    STARTING,
    Listener,
    Replica,
    Sequence,
    plan_output_tokens,
)
from .faults import Faults, exit_process
from .metrics import ModelGauges, ModelMetrics


def prompt_digest(prompt_token_ids: list[int]) -> str:
    """A stable digest of a prompt's token ids (the same on every machine and process; ids
    are validated non-negative and below `vocab_size`). struct, not array: faster from a list."""
    data = struct.pack(f"<{len(prompt_token_ids)}Q", *prompt_token_ids)
    return hashlib.blake2b(data, digest_size=16).hexdigest()


class ModelStatus(TypedDict):
    model: str
    target: int
    ready: int
    starting: int
    draining: int
    cold_start_seconds: float
    running: int
    waiting: int


class ModelFleet:
    def __init__(self, model: ModelConfig, seed: int, faults: Faults | None = None):
        self.model = model
        self.seed = seed
        self.faults = faults if faults is not None else Faults()
        self._priority_policy = model.scheduling_policy == PRIORITY
        self.metrics = ModelMetrics(model.name, model.context_length)
        self.replicas: list[Replica] = []
        self.target_replicas = model.replicas
        self._pending: list[tuple[int, int, Sequence]] = []
        self._pending_count = 0
        self._request_index = itertools.count()
        self._replica_ids = itertools.count()
        self._cold_starts: dict[int, asyncio.TimerHandle] = {}

    # -- lifecycle ------------------------------------------------------------------------

    def start(self) -> None:
        # Replicas in the config are warm when the emulator starts: cold start applies to
        # replicas added later, as when a control plane scales a running fleet.
        for _ in range(self.model.replicas):
            replica = self._new_replica()
            replica.start()
        self._dispatch_pending()

    async def stop(self) -> None:
        for handle in self._cold_starts.values():
            handle.cancel()
        self._cold_starts.clear()
        for replica in list(self.replicas):
            await replica.stop()
        self.replicas.clear()

    def _new_replica(self) -> Replica:
        replica = Replica(
            self.model,
            next(self._replica_ids),
            self.metrics,
            on_stopped=self._on_stopped,
            faults=self.faults,
        )
        self.replicas.append(replica)
        return replica

    def _on_stopped(self, replica: Replica) -> None:
        if replica in self.replicas:
            self.replicas.remove(replica)

    # -- requests -------------------------------------------------------------------------

    def new_sequence(
        self,
        *,
        request_id: str,
        prompt_token_ids: list[int],
        max_tokens: int,
        min_tokens: int,
        ignore_eos: bool,
        priority: int,
        request_seed: int | None,
        prompt_index: int,
        listener: Listener,
        greedy: bool = False,
        image_ends: tuple[int, ...] = (),
    ) -> Sequence:
        """A sequence whose output (ids and length) depends only on the seeds, not timing.

        Greedy (temperature 0) output is a function of the model and the prompt only, as
        with real weights: the same on every replica and process, whatever the config
        `seed`, the request `seed` or what ran before. With a request `seed` it is a
        function of the model, the prompt and that seed. Otherwise it is keyed by the config
        `seed` and this model's arrival counter.
        """
        if greedy:
            key = f"greedy|{self.model.name}|{prompt_digest(prompt_token_ids)}"
        elif request_seed is not None:
            key = f"seed={request_seed}|{self.model.name}|{prompt_digest(prompt_token_ids)}"
        else:
            key = f"{self.seed}|{self.model.name}|{next(self._request_index)}"
        rng = random.Random(key)  # noqa: S311 - reproducible test data, not secrets
        target, reason = plan_output_tokens(
            rng,
            mean_output_tokens=self.model.mean_output_tokens,
            max_tokens=max_tokens,
            min_tokens=min_tokens,
            ignore_eos=ignore_eos,
        )
        return Sequence(
            request_id=request_id,
            prompt_token_ids=prompt_token_ids,
            max_tokens=max_tokens,
            target_output_tokens=target,
            planned_finish_reason=reason,
            priority=priority,
            rng=rng,
            vocab_size=self.model.vocab_size,
            listener=listener,
            arrival_seconds=asyncio.get_running_loop().time(),
            image_ends=image_ends,
        )

    def submit(self, seq: Sequence) -> None:
        replica = self._least_loaded_ready()
        if replica is not None:
            replica.submit(seq)
            return
        loop = asyncio.get_running_loop()
        timeout_seconds = self.model.pending_timeout_seconds
        if timeout_seconds <= 0:
            seq.fail(self._no_replica_message(), loop.time())
            return
        seq.state = PENDING
        key = seq.priority if self._priority_policy else 0
        heapq.heappush(self._pending, (key, seq.order, seq))
        self._pending_count += 1
        loop.call_later(timeout_seconds, self._expire_pending, seq)

    def abort(self, seq: Sequence) -> None:
        now_seconds = asyncio.get_running_loop().time()
        if seq.state == PENDING:
            self._pending_count -= 1
            seq.finish(FINISH_ABORT, now_seconds, self.metrics)
        elif seq.replica is not None:
            seq.replica.abort(seq, now_seconds)

    def _least_loaded_ready(self) -> Replica | None:
        best: Replica | None = None
        for replica in self.replicas:
            if replica.state == READY and (best is None or replica.load < best.load):
                best = replica
        return best

    def _no_replica_message(self) -> str:
        return f"No ready replica of model {self.model.name!r}."

    def _expire_pending(self, seq: Sequence) -> None:
        if seq.state != PENDING:
            return
        self._pending_count -= 1
        seq.fail(
            f"{self._no_replica_message()[:-1]} after waiting "
            f"{self.model.pending_timeout_seconds:g} s.",
            asyncio.get_running_loop().time(),
        )

    def _dispatch_pending(self) -> None:
        while self._pending:
            _priority, _order, seq = self._pending[0]
            if seq.state != PENDING:
                heapq.heappop(self._pending)
                continue
            replica = self._least_loaded_ready()
            if replica is None:
                return
            heapq.heappop(self._pending)
            self._pending_count -= 1
            replica.submit(seq)

    # -- scaling --------------------------------------------------------------------------

    def scale(self, replicas: int) -> None:
        """Set the desired number of replicas (ready + starting; draining ones not counted).

        New replicas serve after `cold_start_seconds`. Removing replicas cancels starting
        ones first, then drains the least-loaded ready ones: they take no new requests and
        stop once their running and waiting requests are done.
        """
        if not 0 <= replicas <= MAX_REPLICAS:
            raise ValueError(f"replicas must be between 0 and {MAX_REPLICAS}, got {replicas}")
        self.target_replicas = replicas
        starting = [r for r in self.replicas if r.state == STARTING]
        ready = [r for r in self.replicas if r.state == READY]
        excess = len(starting) + len(ready) - replicas
        if excess > 0:
            for replica in reversed(starting):
                if excess == 0:
                    break
                self._cold_starts.pop(replica.replica_id).cancel()
                self.replicas.remove(replica)
                excess -= 1
            # Least loaded first; among equals the newest, so long-lived replicas stay.
            for replica in sorted(ready, key=lambda r: (r.load, -r.replica_id))[:excess]:
                replica.drain()
            return
        loop = asyncio.get_running_loop()
        for _ in range(-excess):
            replica = self._new_replica()
            if self.model.cold_start_seconds <= 0:
                replica.start()
            else:
                self._cold_starts[replica.replica_id] = loop.call_later(
                    self.model.cold_start_seconds, self._cold_start_done, replica
                )
        self._dispatch_pending()

    def _cold_start_done(self, replica: Replica) -> None:
        self._cold_starts.pop(replica.replica_id, None)
        replica.start()
        self._dispatch_pending()

    # -- observation ----------------------------------------------------------------------

    def replica_counts(self) -> dict[str, int]:
        counts = {READY: 0, STARTING: 0, DRAINING: 0}
        for replica in self.replicas:
            if replica.state in counts:
                counts[replica.state] += 1
        return counts

    def running_count(self) -> int:
        return sum(len(r.running) for r in self.replicas)

    def waiting_count(self) -> int:
        return self._pending_count + sum(r.waiting_count for r in self.replicas)

    def status(self) -> ModelStatus:
        counts = self.replica_counts()
        return {
            "model": self.model.name,
            "target": self.target_replicas,
            "ready": counts[READY],
            "starting": counts[STARTING],
            "draining": counts[DRAINING],
            "cold_start_seconds": self.model.cold_start_seconds,
            "running": self.running_count(),
            "waiting": self.waiting_count(),
        }

    def gauges(self) -> ModelGauges:
        serving = [r for r in self.replicas if r.state in (READY, DRAINING)]
        capacity_tokens = self.model.kv_cache_tokens * len(serving)
        # Like vLLM, the tokens actually held (prompt + generated so far), not reservations.
        used_tokens = sum(r.context_tokens for r in serving)
        return ModelGauges(
            model_name=self.model.name,
            running=self.running_count(),
            waiting=self.waiting_count(),
            kv_cache_usage_fraction=used_tokens / capacity_tokens if capacity_tokens else 0.0,
            replicas_by_state=self.replica_counts(),
            step_lag_seconds=max((r.step_lag_seconds for r in serving), default=0.0),
        )


class Fleet:
    """Every configured model's `ModelFleet`, in config order."""

    def __init__(self, config: EmulatorConfig, *, crash: Callable[[], None] = exit_process):
        self.config = config
        # One set of faults for the whole process: a replica of the control plane is a process.
        self.faults = Faults(config.faults, crash=crash)
        self.models: dict[str, ModelFleet] = {
            model.name: ModelFleet(model, config.seed, self.faults) for model in config.models
        }

    def get(self, model_name: str) -> ModelFleet | None:
        return self.models.get(model_name)

    def start(self) -> None:
        for model_fleet in self.models.values():
            model_fleet.start()
        self.faults.start()

    async def stop(self) -> None:
        self.faults.stop()
        for model_fleet in self.models.values():
            await model_fleet.stop()
