"""Injected faults of one emulator process: hang, slow, wrong output, crash.

A fault applies to every engine replica of the process (the control plane's `process`
actuator runs one emulator process, serving one replica, per port). It is set on command
(`POST /emulator/faults`) or on a schedule (the config's `faults`, `--fault` on the command
line), and only one fault is active at a time: a new one replaces the one before.

- `hang`: the engines stop stepping. Requests are accepted and queue, streams stop mid-way,
  nothing is answered; `/health`, `/metrics`, `/v1/models` keep answering, as when a real
  engine core hangs behind a live API server. Only an inference request notices.
- `slow`: every engine step takes `factor` times its ground-truth time.
- `wrong_output`: tokens are generated at the usual speed but are not the ones the model
  would give (each id is shifted to a different one), so a fingerprint check fails.
- `crash`: the process exits with status 1 (in-process emulators stop serving instead).
- `none`: clears the active fault and cancels the scheduled ones.
"""

from __future__ import annotations

import asyncio
import math
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypedDict

NONE = "none"
HANG = "hang"
SLOW = "slow"
WRONG_OUTPUT = "wrong_output"
CRASH = "crash"
FAULT_MODES = (NONE, HANG, SLOW, WRONG_OUTPUT, CRASH)
# Modes that can be active (a crash ends the process; none is their absence).
ACTIVE_MODES = (HANG, SLOW, WRONG_OUTPUT)
CRASH_EXIT_CODE = 1


def exit_process() -> None:
    """The crash: no cleanup, no graceful shutdown, as when an engine dies."""
    sys.stderr.write(f"emulator: injected crash, exiting with status {CRASH_EXIT_CODE}\n")
    sys.stderr.flush()
    sys.stdout.flush()
    os._exit(CRASH_EXIT_CODE)


class FaultError(ValueError):
    """A fault spec is invalid; `field` names the offending field."""

    def __init__(self, message: str, field: str):
        super().__init__(message)
        self.field = field


class FaultDict(TypedDict):
    mode: str
    factor: float | None
    at_seconds: float
    duration_seconds: float | None


class ScheduledFault(TypedDict):
    mode: str
    factor: float | None
    starts_in_seconds: float
    duration_seconds: float | None


class FaultStatus(TypedDict):
    mode: str
    factor: float | None
    active_for_seconds: float | None
    ends_in_seconds: float | None
    scheduled: list[ScheduledFault]


@dataclass(frozen=True)
class FaultSpec:
    mode: str
    # Seconds from the emulator's start (config, --fault) or from the command (HTTP).
    at_seconds: float = 0.0
    duration_seconds: float | None = None  # None: until replaced or cleared
    factor: float | None = None  # slow only

    def as_dict(self) -> FaultDict:
        return {
            "mode": self.mode,
            "factor": self.factor,
            "at_seconds": self.at_seconds,
            "duration_seconds": self.duration_seconds,
        }


def _number(path: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise FaultError(f"{path}: must be a finite number, got {value!r}", path)
    return float(value)


def parse_fault(raw: Any, *, path: str = "", at_key: str = "at_seconds") -> FaultSpec:
    """Validate one fault object. `at_key` is `at_seconds` (schedule) or `after_seconds`
    (command). Errors name the field, prefixed with `path` (`faults[0].mode`)."""

    def name(key: str) -> str:
        return f"{path}.{key}" if path else key

    if not isinstance(raw, dict):
        raise FaultError(
            f"{path or 'fault'}: must be an object, got {type(raw).__name__}", path or "fault"
        )
    known = ("mode", "factor", at_key, "duration_seconds")
    unknown = sorted(set(raw) - set(known))
    if unknown:
        raise FaultError(
            f"{name(unknown[0])}: unknown field (known: {', '.join(known)})", name(unknown[0])
        )
    mode = raw.get("mode")
    if mode not in FAULT_MODES:
        raise FaultError(
            f"{name('mode')}: must be one of {', '.join(FAULT_MODES)}, got {mode!r}", name("mode")
        )
    factor = raw.get("factor")
    if mode == SLOW:
        if factor is None:
            raise FaultError(f"{name('factor')}: required for mode 'slow'", name("factor"))
        factor = _number(name("factor"), factor)
        if factor < 1:
            raise FaultError(f"{name('factor')}: must be >= 1, got {factor!r}", name("factor"))
    elif factor is not None:
        raise FaultError(f"{name('factor')}: only applies to mode 'slow'", name("factor"))
    at_seconds = _number(name(at_key), raw.get(at_key, 0))
    if at_seconds < 0:
        raise FaultError(f"{name(at_key)}: must be >= 0, got {at_seconds!r}", name(at_key))
    duration = raw.get("duration_seconds")
    if duration is not None:
        if mode in (NONE, CRASH):
            raise FaultError(
                f"{name('duration_seconds')}: does not apply to mode {mode!r}",
                name("duration_seconds"),
            )
        duration = _number(name("duration_seconds"), duration)
        if duration <= 0:
            raise FaultError(
                f"{name('duration_seconds')}: must be > 0, got {duration!r}",
                name("duration_seconds"),
            )
    if mode == NONE and at_seconds > 0:
        raise FaultError(f"{name(at_key)}: mode 'none' clears faults now", name(at_key))
    return FaultSpec(mode=mode, at_seconds=at_seconds, duration_seconds=duration, factor=factor)


def parse_fault_flag(text: str) -> FaultSpec:
    """`--fault MODE[:FACTOR][@AT_SECONDS][+DURATION_SECONDS]`, e.g. `hang@30`,
    `slow:3@10+20`, `wrong_output@5`, `crash@45`."""
    rest = text.strip()
    raw: dict[str, Any] = {}
    if "+" in rest:
        rest, _, duration = rest.partition("+")
        raw["duration_seconds"] = _flag_number(text, "duration", duration)
    if "@" in rest:
        rest, _, at = rest.partition("@")
        raw["at_seconds"] = _flag_number(text, "start", at)
    if ":" in rest:
        rest, _, factor = rest.partition(":")
        raw["factor"] = _flag_number(text, "factor", factor)
    raw["mode"] = rest
    try:
        return parse_fault(raw)
    except FaultError as exc:
        raise FaultError(f"--fault {text!r}: {exc}", exc.field) from exc


def _flag_number(text: str, what: str, value: str) -> float:
    try:
        number = float(value)
    except ValueError:
        raise FaultError(
            f"--fault {text!r}: the {what} must be a number of seconds"
            + (" (a multiplier)" if what == "factor" else "")
            + f", got {value!r}. Syntax: MODE[:FACTOR][@AT_SECONDS][+DURATION_SECONDS]",
            "fault",
        ) from None
    return number


class Faults:
    """The process's active fault, its scheduled ones, and their timers.

    Engines read `hanging`, `slow_factor` and `wrong_output` every step, and wait on
    `changed()` while hanging. Timers need a running loop: `start()` arms the schedule.
    """

    def __init__(
        self,
        schedule: tuple[FaultSpec, ...] = (),
        *,
        crash: Callable[[], None] = exit_process,
    ):
        self.mode = NONE
        self.factor: float | None = None
        self.started_seconds: float | None = None
        self.ends_seconds: float | None = None
        self._schedule = schedule
        self._crash = crash
        self._changed: asyncio.Event | None = None
        self._generation = 0  # which apply() a duration timer belongs to
        self._timers: dict[asyncio.TimerHandle, tuple[FaultSpec, float]] = {}
        self._duration_timer: asyncio.TimerHandle | None = None

    # -- read by the engines --------------------------------------------------------------

    @property
    def hanging(self) -> bool:
        return self.mode == HANG

    @property
    def slow_factor(self) -> float:
        return self.factor if self.mode == SLOW and self.factor else 1.0

    @property
    def wrong_output(self) -> bool:
        return self.mode == WRONG_OUTPUT

    async def changed(self) -> None:
        """Return at the next change of the active fault."""
        if self._changed is None:
            self._changed = asyncio.Event()
        await self._changed.wait()

    # -- commands -------------------------------------------------------------------------

    def start(self) -> None:
        for spec in self._schedule:
            self.submit(spec)

    def stop(self) -> None:
        for handle in list(self._timers):
            handle.cancel()
        self._timers.clear()
        if self._duration_timer is not None:
            self._duration_timer.cancel()

    def submit(self, spec: FaultSpec) -> None:
        """Apply `spec` now, or arm a timer for `spec.at_seconds` from now."""
        if spec.mode == NONE:
            self.stop()
            self._set(NONE, None, None)
            return
        loop = asyncio.get_running_loop()
        if spec.at_seconds <= 0:
            self._apply(spec)
            return
        handle: asyncio.TimerHandle

        def fire() -> None:
            self._timers.pop(handle, None)
            self._apply(spec)

        handle = loop.call_later(spec.at_seconds, fire)
        self._timers[handle] = (spec, loop.time() + spec.at_seconds)

    def _apply(self, spec: FaultSpec) -> None:
        if spec.mode == CRASH:
            self._do_crash()
            return
        loop = asyncio.get_running_loop()
        if self._duration_timer is not None:
            self._duration_timer.cancel()
            self._duration_timer = None
        ends = None
        if spec.duration_seconds is not None:
            ends = loop.time() + spec.duration_seconds
        self._set(spec.mode, spec.factor, ends)
        if spec.duration_seconds is not None:
            generation = self._generation
            self._duration_timer = loop.call_later(spec.duration_seconds, self._expire, generation)

    def _expire(self, generation: int) -> None:
        self._duration_timer = None
        if generation == self._generation:  # not replaced since
            self._set(NONE, None, None)

    def _set(self, mode: str, factor: float | None, ends_seconds: float | None) -> None:
        self._generation += 1
        self.mode = mode
        self.factor = factor
        now = asyncio.get_running_loop().time()
        self.started_seconds = None if mode == NONE else now
        self.ends_seconds = ends_seconds
        if self._changed is not None:
            self._changed.set()
        self._changed = asyncio.Event()

    def _do_crash(self) -> None:
        self.stop()
        self._crash()

    # -- observation ----------------------------------------------------------------------

    def status(self) -> FaultStatus:
        now = asyncio.get_running_loop().time()
        active_for_seconds = (
            None if self.started_seconds is None else round(now - self.started_seconds, 3)
        )
        ends_in_seconds = (
            None if self.ends_seconds is None else round(max(0.0, self.ends_seconds - now), 3)
        )
        scheduled = sorted(
            (
                ScheduledFault(
                    mode=spec.mode,
                    factor=spec.factor,
                    starts_in_seconds=round(max(0.0, when - now), 3),
                    duration_seconds=spec.duration_seconds,
                )
                for spec, when in self._timers.values()
            ),
            key=lambda entry: entry["starts_in_seconds"],
        )
        return {
            "mode": self.mode,
            "factor": self.factor,
            "active_for_seconds": active_for_seconds,
            "ends_in_seconds": ends_in_seconds,
            "scheduled": scheduled,
        }


def corrupt_token(token_id: int, vocab_size: int) -> int:
    """A different token id than `token_id` (never the same), deterministic."""
    shift = 1 + (token_id * 2654435761) % (vocab_size - 1)
    return (token_id + shift) % vocab_size
