"""Emulator configuration: the emulator's own dataclass and a strict JSON loader.

A model's fields and their validation are the replica profile's
(`simulation.engine.profile`, shared with the fleet simulator); this module adds what only the
emulator has: the scheduled faults and the command-line overrides.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from simulation.engine.profile import (
    DEFAULT_CONTEXT_LENGTH,
    DEFAULT_DECODE_SECONDS_PER_CONTEXT_TOKEN,
    DEFAULT_DECODE_SECONDS_PER_SEQUENCE,
    DEFAULT_DECODE_STEP_BASE_SECONDS,
    DEFAULT_KV_CACHE_TOKENS,
    DEFAULT_MAX_NUM_BATCHED_TOKENS,
    DEFAULT_MAX_NUM_SEQS,
    DEFAULT_MEAN_OUTPUT_TOKENS,
    DEFAULT_PENDING_TIMEOUT_SECONDS,
    DEFAULT_PREFILL_SECONDS_PER_TOKEN,
    DEFAULT_VOCAB_SIZE,
    FCFS,
    MAX_REPLICAS,
    PRIORITY,
    SCHEDULING_POLICIES,
    ConfigError,
    ModelConfig,
)
from simulation.engine.profile import parse_config as parse_profile_config

from .faults import FaultError, FaultSpec, parse_fault

__all__ = [
    "DEFAULT_CONTEXT_LENGTH",
    "DEFAULT_DECODE_SECONDS_PER_CONTEXT_TOKEN",
    "DEFAULT_DECODE_SECONDS_PER_SEQUENCE",
    "DEFAULT_DECODE_STEP_BASE_SECONDS",
    "DEFAULT_KV_CACHE_TOKENS",
    "DEFAULT_MAX_NUM_BATCHED_TOKENS",
    "DEFAULT_MAX_NUM_SEQS",
    "DEFAULT_MEAN_OUTPUT_TOKENS",
    "DEFAULT_PENDING_TIMEOUT_SECONDS",
    "DEFAULT_PREFILL_SECONDS_PER_TOKEN",
    "DEFAULT_VOCAB_SIZE",
    "FCFS",
    "MAX_REPLICAS",
    "PRIORITY",
    "SCHEDULING_POLICIES",
    "ConfigError",
    "EmulatorConfig",
    "ModelConfig",
    "load_config",
    "parse_config",
    "parse_faults",
    "with_overrides",
]


@dataclass(frozen=True)
class EmulatorConfig:
    seed: int = 0
    models: tuple[ModelConfig, ...] = field(default_factory=tuple)
    # Faults to inject, `at_seconds` after the emulator starts (see faults.py).
    faults: tuple[FaultSpec, ...] = field(default_factory=tuple)
    # vLLM's `--enable-prompt-tokens-details` (off by default, as in vLLM): responses' usage
    # then carries `prompt_tokens_details.cached_tokens` when the prefix cache served some.
    enable_prompt_tokens_details: bool = False

    def model(self, name: str) -> ModelConfig | None:
        for model in self.models:
            if model.name == name:
                return model
        return None


def parse_faults(raw: Any) -> tuple[FaultSpec, ...]:
    if not isinstance(raw, list):
        raise ConfigError(f"faults: must be a list of fault objects, got {type(raw).__name__}")
    specs = []
    for i, item in enumerate(raw):
        try:
            spec = parse_fault(item, path=f"faults[{i}]")
        except FaultError as exc:
            raise ConfigError(str(exc)) from exc
        if spec.mode == "none":
            raise ConfigError(f"faults[{i}].mode: 'none' cannot be scheduled")
        specs.append(spec)
    return tuple(specs)


def with_overrides(
    config: EmulatorConfig,
    *,
    scheduling_policy: str | None = None,
    priority_preemption: bool = False,
    faults: tuple[FaultSpec, ...] = (),
    enable_prompt_tokens_details: bool = False,
) -> EmulatorConfig:
    """The config with command-line flags applied to every model (`--scheduling-policy`,
    `--priority-preemption`), `--fault`s added to its schedule and
    `--enable-prompt-tokens-details` set."""
    models = []
    for i, model in enumerate(config.models):
        if scheduling_policy is not None:
            if scheduling_policy not in SCHEDULING_POLICIES:
                raise ConfigError(
                    f"--scheduling-policy: must be one of {', '.join(SCHEDULING_POLICIES)}, "
                    f"got {scheduling_policy!r}"
                )
            model = replace(model, scheduling_policy=scheduling_policy)
        if priority_preemption:
            model = replace(model, priority_preemption=True)
            if model.scheduling_policy != PRIORITY:
                raise ConfigError(
                    "--priority-preemption: needs --scheduling-policy priority "
                    f"(models[{i}] has {model.scheduling_policy!r})"
                )
        models.append(model)
    return replace(
        config,
        models=tuple(models),
        faults=config.faults + tuple(faults),
        enable_prompt_tokens_details=config.enable_prompt_tokens_details
        or enable_prompt_tokens_details,
    )


def parse_config(raw: Any) -> EmulatorConfig:
    """Build an `EmulatorConfig` from decoded JSON, raising `ConfigError` naming the field."""
    profile = parse_profile_config(raw)
    faults = parse_faults(raw.get("faults", []))
    return EmulatorConfig(seed=profile.seed, models=profile.models, faults=faults)


def load_config(path: str | Path) -> EmulatorConfig:
    """Read and validate a JSON config file."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror or exc}") from exc
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path}: invalid JSON at line {exc.lineno}: {exc.msg}") from exc
    return parse_config(raw)
