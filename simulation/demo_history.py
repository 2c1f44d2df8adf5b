"""The demo's week of history, replayed through the fleet simulator (`seed_demo`).

A planner opening a fresh demo would otherwise see empty charts for a day. So seed_demo replays
the last seven days of the demo's customers' demand (`simulation/data/scenarios/demo_week_*.csv`,
request sizes from the Azure traces) through the simulator (`simulation.engine`: the fleet, and
the live allocation policy as its autoscaler) and stores what the live loop would have stored:

- usage minutes (`UsageMinute`) per customer, from the requests the simulated fleet served;
- capacity samples (`CapacitySample`) per model every five minutes (the live tick writes one a
  minute; the fleet page's charts average 10-minute and hourly buckets);
- allocation decisions (`AllocationDecision`) every ten minutes and at every scale event of the
  simulated deployment, hourly for the others;

and leaves one marker, an audit entry `demo.history` (`demo_history_marker`), which the planner
shows above its pages: what was simulated, over which span, and how. Decisions carry the actuator
kind `simulated` and a first reason saying so.

The simulated fleet is the model's reference deployment (`llama-8b-h100`, replicas of 100 MU/min
each); the other deployments are recorded at their minimum. Each simulated request stands for
`REQUESTS_PER_SIMULATED` of the customers' requests (their MU, tokens and counts are multiplied
by it), so a week of ~12 requests/s replays in a few seconds; the policy is priced the same, so
it decides as it would for the whole demand.

Idempotent: with a marker in the audit log nothing is written again.
"""

from __future__ import annotations

import hashlib
import json
import math
import uuid
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

import numpy as np
from django.conf import settings
from django.db import transaction

from capacity.models import (
    AllocationDecision,
    CapacitySample,
    CostModel,
    Deployment,
    ServedModel,
    UsageMinute,
)
from capacity.pricing.cost_models import active_cost_model
from capacity.pricing.features import mu_of, replica_seconds_of
from capacity.selling.sellable import model_capacity
from core.audit import audit_record
from core.models import AuditEntry
from simulation.engine import SERVED, SimulationResult, SimulationSettings, simulate
from simulation.engine.autoscaling import Observation
from simulation.engine.modelunit import LiveDemand, ModelUnitAutoscaler
from simulation.engine.policy_context import PolicyContext
from simulation.engine.profile import parse_config
from simulation.engine.traces import TraceRequest, load_rate_windows

ACTION = "demo.history"
OBJECT_TYPE = "simulation.demohistory"
ACTUATOR_KIND = "simulated"
DATA = Path(__file__).resolve().parent / "data"
# The replica's ground truth: the demo's H100 engines (benchmarking/data/emulator/README.md).
PROFILE = DATA.parent.parent / "benchmarking" / "data" / "emulator" / "llama31-8b_h100_tp1.json"
# customer slug -> (rate windows, the Azure trace its request sizes come from)
DEMAND = {
    "acme": ("scenarios/demo_week_acme.csv", "traces/AzureLLMInferenceTrace_conv_2023.csv"),
    "globex": ("scenarios/demo_week_globex.csv", "traces/AzureLLMInferenceTrace_code_2023.csv"),
}
SPAN = timedelta(days=7)
REQUESTS_PER_SIMULATED = 100
TICK_SECONDS = 60.0
# A decision is stored every this many ticks besides every scale event (the replica charts),
# and one of each deployment held at its minimum every OTHERS_EVERY_TICKS.
DECISION_EVERY_TICKS = 10
OTHERS_EVERY_TICKS = 60
SAMPLE_EVERY_MINUTES = 5
# No simulated decision lies this close to now: the live tick's scale-down stabilisation reads
# the decisions of its last window, and must read only its own.
DECISIONS_STOP_BEFORE_NOW = timedelta(minutes=10)
SEED = 19


@dataclass(frozen=True)
class Seeded:
    start: datetime
    end: datetime
    requests: int
    usage_minutes: int
    capacity_samples: int
    decisions: int
    scale_events: int
    gpu_hours: float


def demo_history_marker() -> AuditEntry | None:
    """The newest demo-history marker, or None on a fleet without demo data. Every planner page
    asks: by object type first, which the audit log's object-history index serves, so a real
    fleet's long log is not scanned for an entry it does not have."""
    return AuditEntry.objects.filter(object_type=OBJECT_TYPE, action=ACTION).order_by("-at").first()


def _monday(moment: datetime) -> datetime:
    day = moment.astimezone(UTC).replace(hour=0, minute=0, second=0, microsecond=0)
    return day - timedelta(days=day.weekday())


def _demand(start: datetime) -> list[TraceRequest]:
    """The customers' requests from `start` for SPAN, thinned to one in REQUESTS_PER_SIMULATED,
    in seconds from `start`. The scenario files begin on a Monday 00:00 UTC and cover two
    weeks, so the seven days ending now fall inside them on the same weekdays and hours."""
    offset_s = (start - _monday(start)).total_seconds()
    span_s = SPAN.total_seconds()
    requests: list[TraceRequest] = []
    for index, (client, (windows, sizes)) in enumerate(sorted(DEMAND.items())):
        for r in load_rate_windows(
            DATA / windows,
            sizes_path=DATA / sizes,
            scale=1 / REQUESTS_PER_SIMULATED,
            seed=SEED + index,
        ):
            if offset_s <= r.arrival_s < offset_s + span_s:
                requests.append(
                    TraceRequest(r.arrival_s - offset_s, r.input_tokens, r.output_tokens, client)
                )
    requests.sort(key=lambda r: r.arrival_s)
    return requests


class _Recorder(ModelUnitAutoscaler):
    """The live policy, keeping each tick's observation and decision.

    Without sub-minute bursts: a thinned trace has lost them (one simulated request is
    REQUESTS_PER_SIMULATED requests arriving at once, a burst no customer sent), so planning
    for them would size the fleet for an artefact of the replay. Minutes are kept whole."""

    def __init__(self, context: PolicyContext, *, stabilisation_seconds: float) -> None:
        super().__init__(context, stabilisation_seconds=stabilisation_seconds)
        self.demand = LiveDemand(context, track_bursts=False)
        self.ticks: list[tuple[Observation, object]] = []

    def decide(self, observation: Observation) -> int:
        target = super().decide(observation)
        self.ticks.append((observation, self.last_decision))
        return target


def _sized(decision_reasons, *, per_replica_mu: float) -> list[dict]:
    """The policy's reasons as stored; the simulated replica's price is not the pool's, so
    the $/MU the policy's messages quote is left out."""
    reasons = [
        {
            "code": "simulated",
            "message": "simulated: demo history replayed through the fleet simulator by "
            "seed_demo, not a live decision",
            "data": {"mu_per_minute_per_replica": per_replica_mu},
        }
    ]
    for reason in decision_reasons:
        message = reason.message
        if " ($" in message:
            message = message[: message.index(" ($")]
        reasons.append({"code": reason.code, "message": message, "data": reason.data})
    return reasons


@transaction.atomic
def demo_history_seed(
    *, now: datetime, customers: dict, deployment: Deployment, reservations_mu_per_minute: dict
) -> Seeded | None:
    """Replay the week before `now` and store it; None when a demo history is already there.

    `customers`: slug -> Customer of DEMAND's slugs; `deployment`: the simulated one (its
    model's reference deployment); `reservations_mu_per_minute`: slug -> MU/min reserved (kept
    warm) over the whole span."""
    if demo_history_marker() is not None:
        return None
    served_model: ServedModel = deployment.served_model
    reference: CostModel | None = active_cost_model(served_model=served_model)
    if reference is None:
        raise ValueError(f"{served_model.name} has no active cost model to price its history")
    end = now.replace(second=0, microsecond=0)
    start = end - SPAN
    requests = _demand(start)
    per_replica = float(reference.replica_mu_per_minute)  # the reference deployment mints R
    request_mu, mean_request_mu = _priced(requests, reference)
    recorder, result = _replay(
        requests,
        deployment=deployment,
        reservations_mu_per_minute=reservations_mu_per_minute,
        replica_mu_per_minute=per_replica,
        request_mu=request_mu,
        mean_request_mu=mean_request_mu,
    )
    usage = _usage_minutes(
        requests, result, customers, served_model, start, end, request_mu,
        reserved=set(reservations_mu_per_minute),
    )  # fmt: skip
    sold = sum(reservations_mu_per_minute.values())
    samples = _capacity_samples(result, recorder, served_model, start, end, sold)
    decisions = _decisions(recorder, deployment, start, end, now, per_replica)
    _store(usage, samples, decisions)
    seeded = Seeded(
        start=start,
        end=end,
        requests=len(requests) * REQUESTS_PER_SIMULATED,
        usage_minutes=len(usage),
        capacity_samples=len(samples),
        decisions=len(decisions),
        scale_events=result.scale_events,
        gpu_hours=result.gpu_hours,
    )
    _mark(seeded, deployment)
    return seeded


def _priced(
    requests: list[TraceRequest], reference: CostModel
) -> tuple[Callable[[TraceRequest], float], float]:
    """(a request's MU, as the reference cost model prices it, for the
    REQUESTS_PER_SIMULATED requests it stands for; the mean of those MU)."""
    weights = reference.weights_replica_seconds
    r_mu = reference.replica_mu_per_minute
    mu = np.array(
        [
            mu_of(
                replica_seconds_of(
                    weights, input_tokens=r.input_tokens, output_tokens=r.output_tokens
                ),
                r_mu,
            )
            for r in requests
        ]
    )
    mu_by_request = {
        id(r): float(m) * REQUESTS_PER_SIMULATED for r, m in zip(requests, mu, strict=True)
    }

    def request_mu(request: TraceRequest) -> float:
        return mu_by_request[id(request)]

    return request_mu, float(mu.mean()) * REQUESTS_PER_SIMULATED if len(mu) else 0.0


def _replay(
    requests: list[TraceRequest],
    *,
    deployment: Deployment,
    reservations_mu_per_minute: dict,
    replica_mu_per_minute: float,
    request_mu: Callable[[TraceRequest], float],
    mean_request_mu: float,
) -> tuple[_Recorder, SimulationResult]:
    """The week through the simulated deployment, sized by the live policy (recorded), warm
    from the start with what the reservations need."""
    (profile,) = parse_config(json.loads(PROFILE.read_text())).models
    guaranteed = sum(reservations_mu_per_minute.values())
    warm = math.ceil(guaranteed / (replica_mu_per_minute * deployment.target_utilisation) - 1e-9)
    context = PolicyContext(
        replica_mu_per_minute=replica_mu_per_minute,
        request_mu=request_mu,
        max_replicas=deployment.max_replicas,
        max_num_seqs=profile.max_num_seqs,
        cold_start_seconds=float(deployment.cold_start_seconds),
        tick_seconds=TICK_SECONDS,
        target_utilisation=deployment.target_utilisation,
        reservations_mu_per_minute=dict(reservations_mu_per_minute),
        keep_warm=True,
        scale_to_zero_after_seconds=deployment.scale_to_zero_after_seconds,
        mean_request_mu=mean_request_mu,
        warm_replicas=max(warm, deployment.min_replicas),
    )
    recorder = _Recorder(
        context, stabilisation_seconds=float(settings.ALLOCATION_STABILISATION_SECONDS)
    )
    result = simulate(
        requests,
        SimulationSettings(
            model=profile,
            cold_start_seconds=float(deployment.cold_start_seconds),
            tick_seconds=TICK_SECONDS,
            initial_replicas=context.warm_replicas,
            horizon_s=SPAN.total_seconds(),
            request_mu=request_mu,
        ),
        recorder,
    )
    return recorder, result


def _store(usage: list, samples: list, decisions: list) -> None:
    """The usage minutes, capacity samples and decisions, each decision at its simulated time."""
    UsageMinute.objects.bulk_create(usage, batch_size=2000)
    CapacitySample.objects.bulk_create(samples, batch_size=2000, ignore_conflicts=True)
    created = AllocationDecision.objects.bulk_create(decisions, batch_size=2000)
    # created_at is auto_now_add: bulk_create stamped now; the simulated times go in after.
    for decision, wanted in zip(created, decisions, strict=True):
        decision.created_at = wanted._simulated_at
        decision.applied_at = None
    AllocationDecision.objects.bulk_update(created, ["created_at"], batch_size=2000)


def _mark(seeded: Seeded, deployment: Deployment) -> None:
    """The marker (`demo_history_marker`): what was simulated, over which span, and how."""
    start, end = seeded.start, seeded.end
    audit_record(
        actor="system:seed_demo",
        action=ACTION,
        object_type=OBJECT_TYPE,
        object_repr=f"demo history {start:%Y-%m-%d %H:%M} to {end:%Y-%m-%d %H:%M} UTC",
        after={
            "from": start.isoformat(),
            "to": end.isoformat(),
            "scenario": sorted(f"simulation/data/{w}" for w, _ in DEMAND.values()),
            "sizes": sorted(f"simulation/data/{s}" for _, s in DEMAND.values()),
            "requests_per_simulated_request": REQUESTS_PER_SIMULATED,
            "simulated_deployment": deployment.name,
            "requests": seeded.requests,
            "usage_minutes": seeded.usage_minutes,
            "capacity_samples": seeded.capacity_samples,
            "decisions": seeded.decisions,
            "scale_events": seeded.scale_events,
        },
        reason="seed_demo replayed a week of demand through the fleet simulator",
    )


def _usage_minutes(requests, result, customers, served_model, start, end, request_mu, *, reserved):
    """Per customer and minute the requests served finished in, as the rollups would hold."""
    totals: dict[tuple[str, int], list[float]] = defaultdict(lambda: [0.0, 0.0, 0.0, 0.0])
    served = result.outcome == SERVED
    for request, ok, finish_s in zip(requests, served, result.finish_s, strict=True):
        if not ok:
            continue
        slot = totals[(request.client, int(finish_s // 60))]
        slot[0] += 1
        slot[1] += request.input_tokens
        slot[2] += request.output_tokens
        slot[3] += request_mu(request)
    span_minutes = int((end - start).total_seconds() // 60)
    rows = []
    for (client, minute), (count, inp, out, mu) in sorted(totals.items()):
        if minute >= span_minutes:
            continue  # finished after now: the live rollups will hold that minute
        # Within its reservation (the demo's use stays well within) a reserved customer is
        # admitted as guaranteed; the others are best-effort.
        guaranteed = client in reserved
        n = REQUESTS_PER_SIMULATED
        rows.append(
            UsageMinute(
                customer=customers[client],
                served_model=served_model,
                minute=start + timedelta(minutes=minute),
                requests=int(count) * n,
                input_tokens=int(inp) * n,
                output_tokens=int(out) * n,
                mu=mu,
                guaranteed_mu=mu if guaranteed else 0.0,
                best_effort_mu=0.0 if guaranteed else mu,
            )
        )
    return rows


def _capacity_samples(result, recorder, served_model, start, end, sold):
    """Every SAMPLE_EVERY_MINUTES, the fleet page's five series: the simulated model's hot
    capacity and use; deployable and sellable as the catalogue has them now; every other model
    at its minimum, unused."""
    capacity = model_capacity(served_model, now=end)
    per_replica = recorder.context.replica_mu_per_minute
    minutes = int((end - start).total_seconds() // 60)
    ready_by_minute = np.zeros(minutes)
    for observation, _ in recorder.ticks:
        minute = int(observation.timestamp_s // 60)
        if 0 <= minute < minutes:
            ready_by_minute[minute] = observation.ready_replicas
    used = np.zeros(minutes)
    for observation, _ in recorder.ticks:
        minute = int((observation.timestamp_s - 1e-6) // 60)
        if 0 <= minute < minutes:
            used[minute] += sum(observation.mu_used_by_client.values())
    rows = []
    for minute in range(0, minutes, SAMPLE_EVERY_MINUTES):
        rows.append(
            CapacitySample(
                served_model=served_model,
                minute=start + timedelta(minutes=minute),
                deployable_mu_per_minute=capacity.deployable_mu_per_minute,
                hot_mu_per_minute=float(ready_by_minute[minute]) * per_replica,
                sellable_mu_per_minute=capacity.sellable_mu_per_minute,
                sold_mu_per_minute=sold,
                used_mu_per_minute=float(used[minute]),
            )
        )
    for other in ServedModel.objects.filter(deployments__isnull=False).exclude(pk=served_model.pk):
        other_capacity = model_capacity(other, now=end)
        rows.extend(
            CapacitySample(
                served_model=other,
                minute=start + timedelta(minutes=minute),
                deployable_mu_per_minute=other_capacity.deployable_mu_per_minute,
                hot_mu_per_minute=other_capacity.hot_mu_per_minute,
                sellable_mu_per_minute=other_capacity.sellable_mu_per_minute,
                sold_mu_per_minute=0.0,
                used_mu_per_minute=0.0,
            )
            for minute in range(0, minutes, SAMPLE_EVERY_MINUTES)
        )
    return rows


def _decisions(recorder, deployment, start, end, now, per_replica):
    """Every DECISION_EVERY_TICKS-th tick's decision and every scale event, for the simulated
    deployment; the others held at their minimum every OTHERS_EVERY_TICKS."""
    stop = now - DECISIONS_STOP_BEFORE_NOW
    others = list(Deployment.objects.exclude(pk=deployment.pk).select_related("served_model"))
    rows = []
    previous_target = None
    for index, (observation, decision) in enumerate(recorder.ticks):
        at = start + timedelta(seconds=observation.timestamp_s)
        if at >= stop or at >= end:
            break
        changed = decision.target_replicas != previous_target
        previous_target = decision.target_replicas
        if not changed and index % DECISION_EVERY_TICKS:
            continue
        tick_id = uuid.uuid5(uuid.NAMESPACE_URL, f"demo-history/{at.isoformat()}")
        rows.append(
            _decision(
                tick_id, at, deployment,
                current=decision.current_replicas,
                recommended=decision.recommended_replicas,
                target=decision.target_replicas,
                reasons=_sized(decision.reasons, per_replica_mu=per_replica),
            )
        )  # fmt: skip
        if index % OTHERS_EVERY_TICKS == 0:
            for other in others:
                held = other.min_replicas
                reason = {"code": "min_replicas", "message": f"{held} replica(s) are the minimum",
                          "data": {"min": held}}  # fmt: skip
                rows.append(
                    _decision(
                        tick_id, at, other, current=held, recommended=held, target=held,
                        reasons=_sized((), per_replica_mu=0.0)[:1] + ([reason] if held else []),
                    )
                )  # fmt: skip
    return rows


def _decision(tick_id, at, deployment, *, current, recommended, target, reasons):
    decision = AllocationDecision(
        tick_id=tick_id,
        deployment=deployment,
        served_model=deployment.served_model,
        inputs_digest=hashlib.sha256(f"{tick_id}/{deployment.pk}".encode()).hexdigest(),
        current_replicas=current,
        recommended_replicas=recommended,
        target_replicas=target,
        reasons=reasons,
        dry_run=False,
        actuator_kind=ACTUATOR_KIND,
        actuator_ok=None,
    )
    decision._simulated_at = at
    return decision
