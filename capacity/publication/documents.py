"""The gateway documents, built from the database (docs/gateway-contract.md).

Each function returns one Redis hash as {field: JSON-ready value}. Reads only; `publish.py`
writes them.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from datetime import datetime, timedelta

from django.conf import settings
from django.db.models import Q

from accounts.models import ApiKey, Customer
from capacity.admission.bucket import Floor
from capacity.admission.gate import output_caps_tokens
from capacity.health.degradation import current_of as current_degradations
from capacity.health.degradation import forget as forget_degradation
from capacity.metering.calibration import bytes_per_token_by_model
from capacity.models import CostModel, Entitlement, Replica, ServedModel


def _seconds(moment: datetime | None) -> float | None:
    return moment.timestamp() if moment is not None else None


def key_documents(*, now: datetime) -> dict[str, dict]:
    """Every usable key, and those revoked or expired within PUBLICATION_REVOKED_KEYS_SECONDS
    (kept with `revoked: true` / their `expires_at`, so that a gateway that missed the
    publication which revoked a key still refuses it)."""
    horizon = now - timedelta(seconds=settings.PUBLICATION_REVOKED_KEYS_SECONDS)
    keys = (
        ApiKey.objects.filter(Q(revoked_at__isnull=True) | Q(revoked_at__gte=horizon))
        .filter(Q(expires_at__isnull=True) | Q(expires_at__gte=horizon))
        .select_related("customer")
        .order_by("prefix")
    )
    return {
        key.prefix: {
            "secret_sha256": key.secret_sha256,
            "kind": "customer" if key.customer_id is not None else "service",
            "customer_id": key.customer_id,
            "customer": key.customer.slug if key.customer is not None else None,
            "scopes": list(key.scopes),
            "expires_at": _seconds(key.expires_at),
            "revoked": key.revoked_at is not None,
        }
        for key in keys
    }


def _published_cost_model(served_model: ServedModel, by_model: dict) -> dict | None:
    # The model's currency is its reference GPU's cost model (docs/design.md#the-currency):
    # active, else the newest candidate, as admission and ingestion price with
    # (pricing_cost_model).
    cost_model = by_model.get(served_model.pk)
    if cost_model is None:
        return None
    return {
        "version": cost_model.version,
        "weights_replica_seconds": dict(cost_model.weights_replica_seconds),
        "replica_mu_per_minute": cost_model.replica_mu_per_minute,
    }


def _pricing_cost_models(served_models: list[ServedModel]) -> dict[int, CostModel]:
    """Per model: the active reference cost model, else the newest candidate; one query."""
    chosen: dict[int, CostModel] = {}
    rank = {CostModel.Status.ACTIVE: 0, CostModel.Status.CANDIDATE: 1}
    reference = {m.pk: m.reference_gpu_type_id for m in served_models}
    rows = (
        CostModel.objects.filter(served_model_id__in=list(reference), status__in=list(rank))
        .order_by("served_model_id", "gpus_per_replica", "-version")
        # Not the fit's record (candidates, residuals): large JSON read every tick for nothing.
        .only(
            "served_model_id",
            "gpu_type_id",
            "gpus_per_replica",
            "status",
            "version",
            "weights_replica_seconds",
            "replica_mu_per_minute",
        )
    )
    for row in rows:
        if row.gpu_type_id != reference[row.served_model_id]:
            continue
        held = chosen.get(row.served_model_id)
        if held is None or rank[row.status] < rank[held.status]:
            chosen[row.served_model_id] = row
    return chosen


def model_documents(*, now: datetime) -> dict[str, dict]:
    """Every served model: its currency, admission's output cap, its bytes per token (its own
    calibration when it has one), its degradation, and its ready replicas (healthy and
    answering their last probe, capacity.health.probes)."""
    served_models = list(ServedModel.objects.order_by("name"))
    calibrated = bytes_per_token_by_model(now=now)
    cost_models = _pricing_cost_models(served_models)
    replicas: dict[int, list[dict]] = defaultdict(list)
    ready = (
        # A replica a benchmark run holds is out of the rotation (benchmarking/isolation.py).
        Replica.objects.filter(
            state=Replica.State.HEALTHY,
            last_ok_at__isnull=False,
            held_by_benchmark_run_id__isnull=True,
        )
        .select_related("deployment__gpu_pool__gpu_type")
        .order_by("deployment__name", "key")
    )
    for replica in ready:
        deployment = replica.deployment
        replicas[deployment.served_model_id].append(
            {
                "endpoint": replica.url,
                "deployment": deployment.name,
                "gpu_type": deployment.gpu_pool.gpu_type.name,
                "priority_scheduling": deployment.priority_scheduling,
            }
        )
    # Degradation is cached for admission (a 2 s window); a publication must say what is
    # stored now, since it is made right after a level changes.
    forget_degradation()
    degradations = current_degradations(m.pk for m in served_models)
    output_caps = output_caps_tokens(m.pk for m in served_models)
    documents = {}
    for served_model in served_models:
        degradation = degradations[served_model.pk]
        documents[served_model.name] = {
            "model_id": served_model.pk,
            "engine_model_id": served_model.engine_model_id,
            "context_length_tokens": served_model.context_length_tokens,
            "cost_model": _published_cost_model(served_model, cost_models),
            "output_cap_tokens": output_caps[served_model.pk],
            "bytes_per_token": calibrated.get(
                served_model.pk, settings.PUBLICATION_BYTES_PER_TOKEN
            ),
            "degradation": {
                "level": degradation.level,
                # True from level 1 on, as before tiers: a gateway that does not read
                # `shed_tiers` errs on refusing all best-effort rather than none.
                "refuse_best_effort": degradation.refuse_best_effort
                or bool(degradation.shed_tiers),
                # While only some tiers are shed: their names (else null: all or none).
                "shed_tiers": list(degradation.shed_tiers) or None,
                "max_tokens_cap": degradation.max_tokens_cap,
                "fallback_model": degradation.fallback_model,
            },
            "replicas": replicas.get(served_model.pk, []),
        }
    return documents


def customer_documents() -> dict[str, int]:
    """Customer slug → id, for a service key that names the customer it acts for."""
    return dict(Customer.objects.order_by("pk").values_list("slug", "pk"))


def customer_tier_documents() -> dict[str, str]:
    """Customer id (decimal text) → its tier's name, for a degradation's `shed_tiers`."""
    rows = Customer.objects.order_by("pk").values_list("pk", "tier_id")
    return {str(pk): tier for pk, tier in rows}


def reservation_documents(floors: Mapping[tuple[int, int], Floor]) -> dict[str, dict]:
    """Customer id (decimal text) → {model name: its reservation floor}: what a gateway admits
    by while it cannot reach Redis (each worker a share of it), from the same floors as the
    admission script's (capacity.admission.floors). A floor is `{"mu_per_minute": now,
    "steps": [[from ms since the epoch, MU/min], ...]}` (later starts and ends)."""
    names = dict(
        ServedModel.objects.filter(pk__in={m for _, m in floors}).values_list("pk", "name")
    )
    documents: dict[str, dict] = defaultdict(dict)
    for (customer_id, model_id), floor in sorted(floors.items()):
        name = names.get(model_id)
        if name is None:
            continue
        documents[str(customer_id)][name] = {
            "mu_per_minute": floor.mu_per_minute,
            "steps": [[round(at_ms), mu] for at_ms, mu in floor.steps],
        }
    return dict(documents)


def entitlement_documents() -> dict[str, list[str]]:
    """Customer id (decimal text) → the names of the models its keys may use."""
    documents: dict[str, list[str]] = defaultdict(list)
    rows = Entitlement.objects.order_by("customer_id", "served_model__name").values_list(
        "customer_id", "served_model__name"
    )
    for customer_id, model_name in rows:
        documents[str(customer_id)].append(model_name)
    return dict(documents)
