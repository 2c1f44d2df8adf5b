from django.core.management.base import BaseCommand, CommandError

from benchmarking.emulator.cli import add_arguments, apply_arguments
from benchmarking.emulator.config import ConfigError, load_config
from benchmarking.emulator.server import run


class Command(BaseCommand):
    help = (
        "Serve an engine emulator: vLLM's OpenAI-compatible API, /metrics and a scale "
        "endpoint, with a configurable ground-truth cost. Ctrl-C stops it."
    )

    def add_arguments(self, parser):
        parser.add_argument("--port", type=int, required=True)
        parser.add_argument(
            "--config", required=True, help="JSON config (see benchmarking/emulator/README.md)."
        )
        parser.add_argument("--host", default="127.0.0.1")
        add_arguments(parser)

    def handle(
        self, *args, port, config, host, scheduling_policy, priority_preemption, fault, **options
    ):
        if not 0 < port < 65536:
            raise CommandError(f"--port must be between 1 and 65535, got {port}.")
        try:
            emulator_config = apply_arguments(
                load_config(config),
                scheduling_policy=scheduling_policy,
                priority_preemption=priority_preemption,
                fault=fault,
            )
        except ConfigError as exc:
            raise CommandError(str(exc)) from exc
        # The emulator is a data-plane test double: it touches no database and no settings.
        run(host, port, emulator_config, print_fn=self._announce)

    def _announce(self, line: str) -> None:
        self.stdout.write(line)
        # Whoever started us may be waiting for this line on a pipe.
        self.stdout.flush()
