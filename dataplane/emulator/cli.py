"""Command-line flags shared by `python -m dataplane.emulator` and its tests."""

from __future__ import annotations

import argparse

from .config import SCHEDULING_POLICIES, ConfigError, EmulatorConfig, with_overrides
from .faults import FaultError, parse_fault_flag


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags beyond --port/--config/--host, shared with the tests."""
    parser.add_argument(
        "--scheduling-policy",
        choices=SCHEDULING_POLICIES,
        default=None,
        help="vLLM's --scheduling-policy for every model (default: the config's, else fcfs, "
        "vLLM's default). Under fcfs a request with a non-zero priority gets vLLM's 400.",
    )
    parser.add_argument(
        "--priority-preemption",
        action="store_true",
        help="With the priority policy, preempt running sequences of a worse priority for a "
        "waiting one that does not fit (vLLM V0's behaviour).",
    )
    parser.add_argument(
        "--enable-prompt-tokens-details",
        action="store_true",
        help="Report prompt_tokens_details.cached_tokens (prefix-cache hits) in responses' "
        "usage, as vLLM does with this flag (off by default in vLLM, and here).",
    )
    parser.add_argument(
        "--fault",
        action="append",
        default=[],
        metavar="MODE[:FACTOR][@AT][+DURATION]",
        help="Inject a fault AT seconds after start (repeatable): hang@30, slow:3@10+20, "
        "wrong_output@5, crash@45.",
    )


def apply_arguments(
    config: EmulatorConfig,
    *,
    scheduling_policy: str | None,
    priority_preemption: bool,
    fault: list[str],
    enable_prompt_tokens_details: bool = False,
) -> EmulatorConfig:
    """The config with the flags applied; raises ConfigError naming the flag."""
    try:
        faults = tuple(parse_fault_flag(text) for text in fault)
    except FaultError as exc:
        raise ConfigError(str(exc)) from exc
    return with_overrides(
        config,
        scheduling_policy=scheduling_policy,
        priority_preemption=priority_preemption,
        faults=faults,
        enable_prompt_tokens_details=enable_prompt_tokens_details,
    )
