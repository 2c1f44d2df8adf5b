"""`python -m dataplane.emulator --port P --config FILE`: the emulator without Django."""

from __future__ import annotations

import argparse
import sys

from .cli import add_arguments, apply_arguments
from .config import ConfigError, load_config
from .server import run


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m dataplane.emulator",
        description="Serve an emulated vLLM fleet (OpenAI-compatible API, /metrics, scaling).",
    )
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--config", required=True, help="JSON config file (see README.md)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument(
        "--startup-seconds",
        type=float,
        default=0.0,
        help="Load for this long before serving, as vLLM loads its weights: the port is bound "
        "at once but connections are refused until then (vLLM binds before building its "
        "engine and listens only once it serves).",
    )
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        config = apply_arguments(
            load_config(args.config),
            scheduling_policy=args.scheduling_policy,
            priority_preemption=args.priority_preemption,
            fault=args.fault,
            enable_prompt_tokens_details=args.enable_prompt_tokens_details,
        )
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.startup_seconds < 0:
        print("error: --startup-seconds must not be negative", file=sys.stderr)
        return 2
    run(args.host, args.port, config, startup_seconds=args.startup_seconds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
