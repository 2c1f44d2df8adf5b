"""A small demo fleet: GPU types, pools, models, deployments, two customers and their keys.

Safe to run again: the catalog is updated in place, and each run revokes the previous demo
keys and prints fresh ones (a key's secret cannot be shown twice).
"""

from decimal import Decimal

from django.core.management.base import BaseCommand
from django.db import transaction
from django.utils import timezone

from accounts import scopes as S
from accounts.models import ApiKey, Customer
from accounts.services import api_key_create
from capacity.models import ActuatorKind, Deployment, GpuPool, GpuType, ServedModel

DEMO_KEY_NAME = "demo key (seed_demo)"

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
    ("llama-3.1-8b", "meta-llama/Llama-3.1-8B-Instruct", 8.0, "H100-80GB", 131072),
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
    ("acme", "Acme Corp", Customer.Tier.ENTERPRISE),
    ("globex", "Globex Inc", Customer.Tier.STANDARD),
]


class Command(BaseCommand):
    help = "Seed a demo fleet and customers, and print fresh demo API keys."

    @transaction.atomic
    def handle(self, *args, **options):
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
                },
            )
        self.stdout.write(
            f"Catalog: {len(GPU_TYPES)} GPU types, {len(POOLS)} pools, {len(MODELS)} models, "
            f"{len(DEPLOYMENTS)} deployments."
        )

        ApiKey.objects.filter(name=DEMO_KEY_NAME, revoked_at__isnull=True).update(
            revoked_at=timezone.now()
        )
        for slug, name, tier in CUSTOMERS:
            customer, _ = Customer.objects.update_or_create(
                slug=slug, defaults={"name": name, "tier": tier}
            )
            created = api_key_create(name=DEMO_KEY_NAME, customer=customer)
            self.stdout.write(f"Customer {slug:<8} key: {created.plaintext}")
        gateway = api_key_create(
            name=DEMO_KEY_NAME,
            service_name="demo-gateway",
            scopes=[S.READ, S.USAGE_WRITE, S.ADMISSION],
        )
        self.stdout.write(f"Service  gateway  key: {gateway.plaintext}")
