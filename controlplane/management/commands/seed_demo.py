"""A small demo fleet: GPU types, pools, models, deployments, two customers and their keys,
a cost model for every deployment, a week of simulated history with one issued invoice, and
acme's portal users (an owner and a member, password DEMO_PORTAL_PASSWORD).

Safe to run again: the catalog is updated in place, each run revokes the previous demo keys and
prints fresh ones (a key's secret cannot be shown twice), and the cost models, the history and
the invoice are made once.
"""

import os
from datetime import timedelta
from decimal import Decimal
from pathlib import Path
from urllib.parse import urlsplit

from django.core.management.base import BaseCommand
from django.db import transaction
from django.utils import timezone

from accounts import scopes as S
from accounts.models import ApiKey, Customer, Membership
from accounts.services import api_key_create, customer_user_set
from benchmarking.models import BenchmarkSuite
from benchmarking.references import deployment_suite_set
from benchmarking.services import benchmark_import, cost_model_fit, suite_create
from billing.generation import invoice_generate, invoice_issue
from billing.models import Invoice, RateCard
from billing.rates import rate_card_create
from capacity.actuation.config import actuator_config_problem
from capacity.allocation.prediction import demand_forecast_fit
from capacity.models import (
    ActuatorKind,
    CostModel,
    DegradationPolicy,
    Deployment,
    GpuPool,
    GpuType,
    Reservation,
    ServedModel,
)
from capacity.selling.entitlements import entitlements_set
from capacity.selling.reservations import reservation_create
from simulation.demo_history import demo_history_seed

DEMO_KEY_NAME = "demo key (seed_demo)"
# scripts/run.sh puts a fresh secret here and the same one in the emulator's
# EMULATOR_WEBHOOK_SECRET; MU_ACTUATOR_* is what actuators may read by default. It binds each
# to the demo's own emulator and supervisor (ACTUATOR_SECRET_DESTINATIONS); unbound, the
# demo's configs are flagged (see _actuate) and the rest of the demo still comes up.
DEMO_WEBHOOK_SECRET_ENV = "MU_ACTUATOR_DEMO_WEBHOOK_SECRET"
DEMO_SUPERVISOR_TOKEN_ENV = "MU_ACTUATOR_DEMO_SUPERVISOR_TOKEN"
# The supervisor's engine (scripts/run.sh: --engine llama-3.1-8b=...) and its replicas' ports.
DEMO_ENGINE = "llama-3.1-8b"
DEMO_REPLICA_BASE_PORT = 8111

GPU_TYPES = [
    ("H100-80GB", 80, Decimal("4.2500")),
    ("A100-80GB", 80, Decimal("2.1000")),
    ("L40S-48GB", 48, Decimal("1.1000")),
]
POOLS = [
    ("us-east-h100", "H100-80GB", 16),
    ("us-east-a100", "A100-80GB", 16),
    ("eu-west-l40s", "L40S-48GB", 8),
]
MODELS = [
    # Engine ids match the models of the engine emulator's demo config.
    ("llama-3.1-8b", "llama-3.1-8b", 8.0, "H100-80GB", 8192),
    ("qwen2.5-72b", "Qwen/Qwen2.5-72B-Instruct", 72.0, "H100-80GB", 32768),
]
DEPLOYMENTS = [
    # name, model, pool, gpus/replica, min, max, cold start s, scale-to-zero s
    ("llama-8b-h100", "llama-3.1-8b", "us-east-h100", 1, 1, 8, 90, None),
    ("llama-8b-l40s", "llama-3.1-8b", "eu-west-l40s", 1, 0, 8, 120, 900),
    ("qwen-72b-h100", "qwen2.5-72b", "us-east-h100", 4, 1, 2, 300, None),
    ("qwen-72b-a100", "qwen2.5-72b", "us-east-a100", 4, 0, 4, 360, 1800),
]
CUSTOMERS = [
    ("acme", "Acme Corp", "enterprise"),
    ("globex", "Globex Inc", "standard"),
]


DEMO_SUITE = {
    "name": "demo-quick",
    "description": "A small grid that finishes in a few minutes against the emulator.",
    "grid": [[128, 64], [512, 64], [2048, 64], [128, 256], [512, 256], [1024, 128], [256, 32]],
    "slo_ttft_p95_ms": 2000.0,
    "slo_tpot_p95_ms": 60.0,
    "duration_per_point_seconds": 5.0,
    "concurrency_start": 4,
    "max_concurrency": 64,
}
DATA = Path(__file__).resolve().parents[3] / "benchmarking" / "data"
# One throughput table per demo deployment's (model, GPU type, GPUs per replica), imported and
# fitted once: NVIDIA's published TensorRT-LLM table for the reference llama on H100, and for the
# others tables measured on the engine emulator with a profile per GPU type
# (benchmarking/data/emulator/README.md says how each was made).
DEMO_TABLES = [
    ("llama-3.1-8b", "H100-80GB", 1, DATA / "trtllm_llama31-8b_fp8_h100_tp1.csv"),
    ("llama-3.1-8b", "L40S-48GB", 1, DATA / "emulator" / "llama31-8b_l40s_tp1.csv"),
    ("qwen2.5-72b", "H100-80GB", 4, DATA / "emulator" / "qwen25-72b_h100_tp4.csv"),
    ("qwen2.5-72b", "A100-80GB", 4, DATA / "emulator" / "qwen25-72b_a100_tp4.csv"),
]
DEMO_RESERVATION_MU_PER_MINUTE = 300
# acme's people in the customer portal (/portal/): the owner manages its keys, the member reads.
# scripts/run.sh prints the password beside the planner's (the same environment variable).
DEMO_PORTAL_USERS = [
    ("acme-owner", "acme", Membership.Role.OWNER),
    ("acme-member", "acme", Membership.Role.MEMBER),
]
DEMO_PORTAL_PASSWORD_ENV = "DEMO_PORTAL_PASSWORD"
DEMO_PORTAL_PASSWORD = "demo-portal-password"


class Command(BaseCommand):
    help = "Seed a demo fleet and customers, and print fresh demo API keys."

    def add_arguments(self, parser):
        parser.add_argument(
            "--supervisor-url",
            default="",
            help="Run the demo's llama H100 replicas with the process actuator through this "
            "process supervisor (python -m dataplane.supervisor), one emulator each.",
        )
        parser.add_argument(
            "--replica-base-port",
            type=int,
            default=DEMO_REPLICA_BASE_PORT,
            help="Port of the first supervisor replica (the next ones follow).",
        )
        parser.add_argument(
            "--emulator-url",
            default="",
            help="Scale the demo's llama L40S deployment in this engine emulator by webhook.",
        )

    @transaction.atomic
    def handle(
        self, *args, emulator_url="", supervisor_url="", replica_base_port=DEMO_REPLICA_BASE_PORT,
        **options,
    ):  # fmt: skip
        gpu_types, pools, models = self._catalog()
        # Prices from the start of last month, so that this month's estimate is priced.
        first = (timezone.now().replace(day=1) - timedelta(days=1)).replace(
            day=1, hour=0, minute=0, second=0, microsecond=0
        )
        self._rate_cards(models, first)
        self._deployments(pools, models)
        self._data_plane(
            supervisor_url=supervisor_url,
            replica_base_port=replica_base_port,
            emulator_url=emulator_url,
        )
        # While fewer than 3 in 4 of its probed replicas answer, the demo model sheds
        # best-effort traffic, then caps max_tokens (planners edit this on the Health page).
        DegradationPolicy.objects.get_or_create(
            served_model=models["llama-3.1-8b"], defaults={"max_tokens_cap": 512}
        )
        self._cost_models(gpu_types, models)
        self.stdout.write(
            f"Catalog: {len(GPU_TYPES)} GPU types, {len(POOLS)} pools, {len(MODELS)} models, "
            f"{len(DEPLOYMENTS)} deployments."
        )
        self._customers_and_keys(models)
        self._reservation(models, first)
        self._history(first)
        self._portal_users()

    def _catalog(
        self,
    ) -> tuple[dict[str, GpuType], dict[str, GpuPool], dict[str, ServedModel]]:
        """GPU types, pools and models, updated in place, each by name."""
        gpu_types = {}
        for name, memory_gb, cost in GPU_TYPES:
            gpu_types[name], _ = GpuType.objects.update_or_create(
                name=name, defaults={"memory_gb": memory_gb, "hourly_cost_usd": cost}
            )
        pools = {}
        for name, gpu_type, count in POOLS:
            pools[name], _ = GpuPool.objects.update_or_create(
                name=name, defaults={"gpu_type": gpu_types[gpu_type], "gpu_count": count}
            )
        models = {}
        for name, engine_id, params, ref_gpu, context in MODELS:
            models[name], _ = ServedModel.objects.update_or_create(
                name=name,
                defaults={
                    "engine_model_id": engine_id,
                    "parameters_billions": params,
                    "reference_gpu_type": gpu_types[ref_gpu],
                    "context_length_tokens": context,
                },
            )
        return gpu_types, pools, models

    def _rate_cards(self, models: dict[str, ServedModel], first) -> None:
        """A rate card per model from `first`, unless the model has one."""
        for model in models.values():
            if not RateCard.objects.filter(served_model=model).exists():
                rate_card_create(
                    served_model=model,
                    effective_from=first,
                    reserved_price_per_mu_minute_hour=Decimal("0.02"),
                    best_effort_price_per_1000_mu=Decimal("0.50"),
                    # A fifth more for capacity held hot while idle.
                    keep_warm_price_per_mu_minute_hour=Decimal("0.004"),
                )

    def _deployments(self, pools: dict[str, GpuPool], models: dict[str, ServedModel]) -> None:
        """The demo's deployments, dry-run until `_data_plane` points some at real engines."""
        for name, model, pool, gpus, low, high, cold, idle in DEPLOYMENTS:
            Deployment.objects.update_or_create(
                name=name,
                defaults={
                    "served_model": models[model],
                    "gpu_pool": pools[pool],
                    "gpus_per_replica": gpus,
                    "min_replicas": low,
                    "max_replicas": high,
                    "current_replicas": low,
                    "cold_start_seconds": cold,
                    "scale_to_zero_after_seconds": idle,
                    "actuator_kind": ActuatorKind.DRY_RUN,
                    "actuator_config": {},
                    "actuator_config_problem": "",
                },
            )

    def _data_plane(
        self, *, supervisor_url: str, replica_base_port: int, emulator_url: str
    ) -> None:
        """The llama deployments scaled for real when the demo runs a data plane: the H100 one
        through the process supervisor, the L40S one in the emulator by webhook."""
        if supervisor_url:
            # The allocation loop asks the supervisor for this deployment's replica count; it
            # runs one emulator process per replica on consecutive ports (scripts/run.sh).
            parts = urlsplit(supervisor_url)
            config = {
                "engine": DEMO_ENGINE,
                "host": parts.hostname or "127.0.0.1",
                "base_port": replica_base_port,
                "supervisor_url": supervisor_url,
                "drain_seconds": 10,
                "token_env": DEMO_SUPERVISOR_TOKEN_ENV,
            }
            self._actuate(
                "llama-8b-h100",
                ActuatorKind.PROCESS,
                config,
                # Benchmarks measure this URL: the first replica, which always runs (min 1).
                endpoint_url=f"http://{config['host']}:{replica_base_port}",
            )
        if emulator_url:
            # The allocation loop pushes this deployment's targets to the emulator, signed.
            config = {
                "url": f"{emulator_url}/admin/webhook/scale",
                "secret_env": DEMO_WEBHOOK_SECRET_ENV,
            }
            self._actuate("llama-8b-l40s", ActuatorKind.WEBHOOK, config, endpoint_url=emulator_url)

    def _cost_models(self, gpu_types: dict[str, GpuType], models: dict[str, ServedModel]) -> None:
        """The demo's benchmark suite, the llama H100 deployment's; and a cost model fitted from
        each of DEMO_TABLES for which none exists yet."""
        suite = BenchmarkSuite.objects.filter(name=DEMO_SUITE["name"]).first()
        if suite is None:
            suite = suite_create(**DEMO_SUITE)
        for deployment in Deployment.objects.filter(name="llama-8b-h100"):
            deployment_suite_set(deployment=deployment, suite=suite)
        for model_name, gpu_name, gpus, table in DEMO_TABLES:
            if CostModel.objects.filter(
                served_model=models[model_name],
                gpu_type=gpu_types[gpu_name],
                gpus_per_replica=gpus,
            ).exists():
                continue
            run, _ = benchmark_import(
                csv_text=table.read_text(),
                model_name=model_name,
                gpu_name=gpu_name,
                gpus_per_replica=gpus,
                source_detail=str(table.relative_to(DATA.parent.parent)),
            )
            cost_model = cost_model_fit(run=run)
            self.stdout.write(
                f"Cost model: {model_name} on {gpu_name}×{gpus} v{cost_model.version} "
                f"({cost_model.status}, CV MAPE {cost_model.cv_mape:.1%}) from {table.name}."
            )

    def _customers_and_keys(self, models: dict[str, ServedModel]) -> None:
        """The demo customers, entitled to every demo model, and fresh keys for them and the
        gateway (the previous run's demo keys revoked)."""
        ApiKey.objects.filter(name=DEMO_KEY_NAME, revoked_at__isnull=True).update(
            revoked_at=timezone.now()
        )
        for slug, name, tier in CUSTOMERS:
            customer, _ = Customer.objects.update_or_create(
                slug=slug, defaults={"name": name, "tier_id": tier}
            )
            # With `admission`, so the key works at the gateway (which asks admission for it).
            created = api_key_create(
                name=DEMO_KEY_NAME, customer=customer, scopes=[S.READ, S.WRITE, S.ADMISSION]
            )
            self.stdout.write(f"Customer {slug:<8} key: {created.plaintext}")
            # The demo customers may use every demo model through the gateway.
            entitlements_set(
                customer=customer,
                served_models=[models[name] for name, *_ in MODELS],
                actor="system:seed_demo",
            )
        gateway = api_key_create(
            name=DEMO_KEY_NAME,
            service_name="demo-gateway",
            scopes=[S.READ, S.USAGE_WRITE, S.ADMISSION],
        )
        self.stdout.write(f"Service  gateway  key: {gateway.plaintext}")

    def _reservation(self, models: dict[str, ServedModel], first) -> None:
        """acme's reservation of the llama, kept warm, unless acme has one."""
        acme = Customer.objects.filter(slug="acme").first()
        if acme and not Reservation.objects.filter(customer=acme).exists():
            # From the start of last month, as the rate cards: the week of history and last
            # month's invoice both hold it.
            reservation = reservation_create(
                customer=acme,
                served_model=models["llama-3.1-8b"],
                mu_per_minute=DEMO_RESERVATION_MU_PER_MINUTE,
                starts_at=first,
                keep_warm=True,
                notes="demo reservation (seed_demo)",
                actor="seed_demo",
            )
            self.stdout.write(
                f"Reservation: acme {reservation.mu_per_minute:g} MU/min of llama-3.1-8b, "
                f"kept warm, from {first:%Y-%m-%d}."
            )

    def _portal_users(self) -> None:
        password = os.environ.get(DEMO_PORTAL_PASSWORD_ENV) or DEMO_PORTAL_PASSWORD
        customers = {c.slug: c for c in Customer.objects.filter(slug__in=["acme", "globex"])}
        for username, slug, role in DEMO_PORTAL_USERS:
            customer_user_set(
                username=username, password=password, customer=customers[slug], role=role
            )
            # The password is not printed here (this output is logged); run.sh shows it.
            self.stdout.write(
                f"Portal: {username} ({role} of {slug}) logs in at /portal/ with "
                f"{DEMO_PORTAL_PASSWORD_ENV}."
            )

    def _history(self, first) -> None:
        """A week of demo traffic replayed through the simulator, then last month's invoice
        for acme issued: the planner's charts and invoices have something to show at once."""
        customers = {c.slug: c for c in Customer.objects.filter(slug__in=["acme", "globex"])}
        seeded = demo_history_seed(
            now=timezone.now(),
            customers=customers,
            deployment=Deployment.objects.select_related("served_model").get(name="llama-8b-h100"),
            reservations_mu_per_minute={"acme": float(DEMO_RESERVATION_MU_PER_MINUTE)},
        )
        if seeded is None:
            self.stdout.write("History: already seeded (the audit log's demo.history entry).")
        else:
            self.stdout.write(
                f"History: {seeded.start:%Y-%m-%d %H:%M} to {seeded.end:%Y-%m-%d %H:%M} UTC "
                f"replayed through the fleet simulator (demo data): {seeded.requests:,} requests, "
                f"{seeded.usage_minutes:,} usage minutes, {seeded.capacity_samples:,} capacity "
                f"samples, {seeded.decisions:,} decisions ({seeded.scale_events} scale events)."
            )
        # The demand forecast from that week at once (its schedule's first run is an hour
        # after beat starts): the planner's allocation page draws it, and the tick predicts.
        fitted = demand_forecast_fit()
        self.stdout.write(
            f"Forecast: {fitted['fitted']} model(s) fitted from their recorded demand, "
            f"{fitted['too_little_history']} with too little history."
        )
        acme = customers["acme"]
        period = first.date()
        if Invoice.objects.filter(customer=acme, period_start=period).exists():
            return
        invoice_generate(period=period)
        invoice = Invoice.objects.filter(
            customer=acme, period_start=period, status=Invoice.Status.DRAFT
        ).first()
        # A demo database from before acme's reservation was back-dated bills nothing then.
        if invoice is not None and invoice.lines.exists():
            invoice = invoice_issue(invoice=invoice, actor="system:seed_demo")
            self.stdout.write(
                f"Invoice: acme {period:%Y-%m} issued, {invoice.total} {invoice.currency} "
                f"({invoice.lines.count()} lines)."
            )

    def _actuate(self, name: str, kind: str, config: dict, *, endpoint_url: str) -> None:
        """Point a demo deployment at the demo's data plane. A config the operator's settings
        refuse is flagged rather than refused, so the rest of the demo still comes up."""
        problem = actuator_config_problem(kind, config)
        if problem:
            self.stderr.write(f"The demo's {kind} deployment {name} is refused: {problem}")
        Deployment.objects.filter(name=name).update(
            endpoint_url=endpoint_url,
            # scripts/run.sh starts the demo's engines with --scheduling-policy priority.
            priority_scheduling=True,
            actuator_kind=kind,
            actuator_config=config,
            actuator_config_problem=problem,
        )
