"""Compare autoscaling policies on a demand trace with the fleet simulator (no database).

Model (--model-config): a JSON file holding either one model object with `ModelConfig`'s
fields (`{"name": "70b", "max_num_seqs": 128, ...}`) or an emulator config
(`{"models": [...]}`, the first model is used); it is validated like the emulator's config.
Without it, the built-in profile: the emulator's defaults, i.e. an 8B dense model on one H100
(bf16, max_num_seqs 256, 200k KV tokens), with a 60 s cold start.

Scenario (--scenario, optional JSON; every key is optional):
    {"customers": {"acme": {"reservation_mu_per_minute": 300, "keep_warm": true}},
     "cold_start_seconds": 60, "target_utilisation": 0.8}
`customers` gives the reservations (MU/min) the policies are told about and whose unserved
requests count as `guaranteed_refused`; any customer with `keep_warm` keeps one replica warm.
Every policy runs behind the live admission (the reservations, then the live policy's
allowances; see simulation.engine.compare): `refused G` and `refused BE` are the shares of the
reserved customers' and of the other customers' requests refused.
`cold_start_seconds` overrides the model's; `target_utilisation` (0 < u ≤ 1, default 0.8) is
the share of a replica's saturated throughput the policies plan for.

Policies: static-peak (always, the reference for `savings`), kpa, hpa-rps, oracle (the old
lower bound on 60 s demand at the target utilisation), modelunit (the live policy), and two
found by search in the simulator (simulation.engine.oracle_slo): static-slo, the cheapest static
fleet that keeps the TTFT objective (99 % of requests within --slo-ttft-ms), and oracle-slo, the
hindsight trajectory that keeps it. With both, `of oracle-slo` is each policy's share of
oracle-slo's saving over static-slo. They cost several runs of the trace each, so they run only
when asked for.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from django.conf import settings as django_settings
from django.core.management.base import BaseCommand, CommandError

from simulation.engine.compare import PolicyError, compare, known_policies, policy_registry
from simulation.engine.profile import ConfigError, ModelConfig, parse_config
from simulation.engine.traces import TraceError, load_trace

BUILT_IN_MODEL = ModelConfig(name="8b-h100", cold_start_seconds=60.0)
DEFAULT_POLICIES = ("static-peak", "kpa", "hpa-rps", "oracle", "modelunit")
# What --policies accepts (compare's names).
POLICY_CHOICES = known_policies()
_SCENARIO_KEYS = {"customers", "cold_start_seconds", "target_utilisation"}
_CUSTOMER_KEYS = {"reservation_mu_per_minute", "keep_warm"}


def _read_json(path: str, what: str):
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise CommandError(f"cannot read {what} {path}: {exc.strerror or exc}") from exc
    except json.JSONDecodeError as exc:
        raise CommandError(f"{path}: invalid JSON at line {exc.lineno}: {exc.msg}") from exc


def load_model(path: str | None) -> ModelConfig:
    """The replica of `--model-config` (a file of ModelConfig's fields), or the built-in one."""
    if path is None:
        return BUILT_IN_MODEL
    raw = _read_json(path, "model config")
    if isinstance(raw, dict) and "models" not in raw:
        raw = {"models": [raw]}
    try:
        return parse_config(raw).models[0]
    except ConfigError as exc:
        raise CommandError(f"{path}: {exc}") from exc


def _number(path: str, key: str, value, *, low: float, high: float = math.inf) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise CommandError(f"{path}: {key} must be a number, got {value!r}")
    if not (math.isfinite(value) and low <= value <= high):
        raise CommandError(f"{path}: {key} must be between {low} and {high}, got {value!r}")
    return float(value)


def load_scenario(path: str | None) -> dict:
    """{"reservations": {...}, "keep_warm": bool, "cold_start_seconds": float | None,
    "target_utilisation": float}."""
    scenario = {
        "reservations": {},
        "keep_warm": False,
        "cold_start_seconds": None,
        "target_utilisation": 0.8,
    }
    if path is None:
        return scenario
    raw = _read_json(path, "scenario")
    if not isinstance(raw, dict):
        raise CommandError(f"{path}: the scenario must be a JSON object")
    unknown = sorted(set(raw) - _SCENARIO_KEYS)
    if unknown:
        raise CommandError(
            f"{path}: unknown key {unknown[0]!r} (known: {', '.join(sorted(_SCENARIO_KEYS))})"
        )
    customers = raw.get("customers", {})
    if not isinstance(customers, dict):
        raise CommandError(f"{path}: customers must be an object of customer name -> settings")
    for name, settings in customers.items():
        where = f"customers.{name}"
        if not isinstance(settings, dict):
            raise CommandError(f"{path}: {where} must be an object")
        unknown = sorted(set(settings) - _CUSTOMER_KEYS)
        if unknown:
            raise CommandError(
                f"{path}: {where}.{unknown[0]}: unknown key "
                f"(known: {', '.join(sorted(_CUSTOMER_KEYS))})"
            )
        if "reservation_mu_per_minute" in settings:
            scenario["reservations"][name] = _number(
                path,
                f"{where}.reservation_mu_per_minute",
                settings["reservation_mu_per_minute"],
                low=0.0,
            )
        keep_warm = settings.get("keep_warm", False)
        if not isinstance(keep_warm, bool):
            raise CommandError(f"{path}: {where}.keep_warm must be true or false")
        scenario["keep_warm"] = scenario["keep_warm"] or keep_warm
    if "cold_start_seconds" in raw:
        scenario["cold_start_seconds"] = _number(
            path, "cold_start_seconds", raw["cold_start_seconds"], low=0.0
        )
    if "target_utilisation" in raw:
        value = _number(path, "target_utilisation", raw["target_utilisation"], low=0.0, high=1.0)
        if value == 0:
            raise CommandError(f"{path}: target_utilisation must be > 0")
        scenario["target_utilisation"] = value
    return scenario


def _fmt(value: float, spec: str) -> str:
    return "-" if isinstance(value, float) and math.isnan(value) else format(value, spec)


class Command(BaseCommand):
    help = (
        "Simulate a model's fleet over a demand trace under several autoscaling policies "
        f"({', '.join(POLICY_CHOICES)}) and compare GPU-hours and latency."
    )

    def add_arguments(self, parser):
        parser.add_argument("--trace", required=True, help="Per-request trace or rate windows.")
        parser.add_argument("--sizes", help="Per-request trace to draw sizes from (windows).")
        parser.add_argument("--scenario", help="Scenario JSON (see the module docstring).")
        parser.add_argument("--scale", type=float, default=1.0, help="Demand multiplier.")
        parser.add_argument(
            "--policies",
            default=",".join(DEFAULT_POLICIES),
            help=(
                f"Comma-separated, of {', '.join(POLICY_CHOICES)} (default: "
                f"{','.join(DEFAULT_POLICIES)}; static-peak always runs, as the reference)."
            ),
        )
        parser.add_argument("--slo-ttft-ms", type=float, default=2000.0)
        parser.add_argument("--seed", type=int, default=0)
        parser.add_argument("--model-config", help="Model JSON (default: built-in 8B on H100).")
        parser.add_argument("--json", action="store_true", help="Print JSON instead of a table.")

    def handle(self, *args, **options):
        model = load_model(options["model_config"])
        scenario = load_scenario(options["scenario"])
        policies = [p.strip() for p in options["policies"].split(",") if p.strip()]
        if not policies:
            raise CommandError("--policies must name at least one policy")
        if "modelunit" in policies:
            _, missing = policy_registry()
            if "modelunit" in missing:
                self.stderr.write(f"{missing['modelunit']}; leaving it out")
                policies.remove("modelunit")
        try:
            requests = load_trace(
                options["trace"],
                sizes_path=options["sizes"],
                scale=options["scale"],
                seed=options["seed"],
            )
        except TraceError as exc:
            raise CommandError(str(exc)) from exc
        if not requests:
            raise CommandError(f"{options['trace']}: the trace has no requests")
        try:
            report = compare(
                requests,
                model=model,
                policies=policies,
                slo_ttft_ms=options["slo_ttft_ms"],
                cold_start_seconds=scenario["cold_start_seconds"],
                target_utilisation=scenario["target_utilisation"],
                reservations=scenario["reservations"],
                keep_warm=scenario["keep_warm"],
                stabilisation_seconds=float(django_settings.ALLOCATION_STABILISATION_SECONDS),
                burst_seconds=float(django_settings.ADMISSION_BURST_SECONDS),
            )
        except (PolicyError, ValueError) as exc:
            raise CommandError(str(exc)) from exc
        if options["json"]:
            self.stdout.write(json.dumps(report, indent=2))
            return
        self._table(report)

    def _table(self, report: dict) -> None:
        header = (
            f"{'policy':<12} {'gpu_hours':>9} {'savings':>8} {'slo':>7} "
            f"{'ttft p50/p95/p99 ms':>24} {'tpot p95':>9} {'refused':>7} {'scale events':>12} "
            f"{'refused G':>9} {'refused BE':>10} {'of oracle-slo':>13}"
        )
        self.stdout.write(header)
        self.stdout.write("-" * len(header))
        for name, row in report["policies"].items():
            ttft = "/".join(
                _fmt(row[k], ".0f") for k in ("ttft_p50_ms", "ttft_p95_ms", "ttft_p99_ms")
            )
            self.stdout.write(
                f"{name:<12} {row['gpu_hours']:>9.3f} {_fmt(row['savings_vs_static'], '.1%'):>8} "
                f"{row['slo_attainment']:>7.2%} {ttft:>24} {_fmt(row['tpot_p95_ms'], '.1f'):>9} "
                f"{row['guaranteed_refused']:>7} {row['scale_events']:>12} "
                f"{_fmt(row['refused_guaranteed_share'], '.2%'):>9} "
                f"{_fmt(row['refused_best_effort_share'], '.2%'):>10} "
                f"{_fmt(row['oracle_slo_savings_share'], '.0%'):>13}"
            )
