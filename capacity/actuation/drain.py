"""Which replicas a Kubernetes scale-down removes, chosen before it happens, where the platform
honours the choice; and drained replicas the platform kept, serving again.

Left alone, the platform picks the pods to delete itself, so a pod serving long streams can be
the one killed. Before a scale-down the tick (`capacity/allocation/tick.py`, `_leaving`) asks
`plan` who picks and whether a choice of ours holds:

- mode `replicas`, a Deployment, or an InferenceService in RawDeployment mode (KServe's HPA,
  pinned to the target, scales the `<name>-predictor` Deployment) or under autoscalerClass
  `external`: the ReplicaSet controller picks, not-ready pods first, then the lowest
  `controller.kubernetes.io/pod-deletion-cost`. The tick drains the least loaded ready pods
  and the actuator lowers their deletion cost before the scale-down (this mode's Role may
  patch pods).
- mode `replicas`, a StatefulSet or a LeaderWorkerSet: its controller removes the highest
  ordinals, always. The tick drains those (nothing to annotate).
- mode `replicas`, an InferenceService in Serverless mode: KServe writes the bounds into the
  Knative Service's revision template, so new bounds are a new Knative revision, whose pods
  replace every pod of the old one once ready. No pod of the old one is picked: nothing is
  drained (`drain_skipped` on the decision).
- mode `replicas`, kind Custom: its controller picks in a way not known here: nothing is
  drained (`drain_skipped`).
- mode `hpa-bounds`: the HPA decides when (its scale-down behaviour may pace it over
  minutes), the workload's controller which pods; this mode's Role grants no pod `patch`.
  Nothing is drained; `drain_skipped` when new bounds force a scale-down.
- mode `metric`: the autoscaler that reads `mu_desired_replicas` scales, the workload's
  controller picks; the Role grants no write at all. Nothing is drained; `drain_skipped`
  while the workload runs more than the target.
- any mode without `pod_selector`: the pods are not known by name: nothing is drained
  (`drain_skipped`).

A ReplicaSet deletes its not-ready pods before any ready one (kubernetes/kubernetes
`ActivePodsWithRanks`), so only the ready pods above the target are drained. Least loaded is by
the requests their engine had running at the last probe (`Replica.running_requests`, the
engine's own vllm:num_requests_running). The drained pods turn `draining`
(`Replica.State.DRAINING`) and the gateways' documents are republished before the scale-down,
so gateways route nothing new to them while their engines finish what they serve (vLLM
finishes in-flight requests on SIGTERM within the pod's terminationGracePeriodSeconds:
deploy/README.md). If the push fails they serve again at once. The decision records the drain
(reason `drain`, naming the pods) or why there is none (`drain_skipped`).

A drained pod can outlive its scale-down: something else set a lower deletion cost on another
pod, the cluster runs without the PodDeletionCost feature, a rollout's ReplicaSets shared the
scale-down, a later tick raised the target again. The health probes, which list the pods, hand
such a pod back (`serve_survivors`): once no drain of its deployment is younger than
HEALTH_DRAIN_SETTLE_SECONDS and the data plane lists no more ready pods than the target, a
draining pod still listed ready (not terminating) is one the platform kept, and it serves
again.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from datetime import datetime, timedelta

from django.conf import settings

from capacity.actuation.base import KNATIVE, REPLICA_SET, Observation
from capacity.actuation.kubernetes import mode_of
from capacity.models import AllocationDecision, Deployment, Replica

logger = logging.getLogger(__name__)

# How a drain is honoured (Plan.how, and the `drain` reason's data).
DELETION_COST = "pod-deletion-cost"
ORDINALS = "ordinals"
# The reasons on the decision.
DRAINED = "drain"
SKIPPED = "drain_skipped"

_ORDINAL_KINDS = ("StatefulSet", "LeaderWorkerSet")
_TRAILING_NUMBER = re.compile(r"-(\d+)$")


@dataclass(frozen=True)
class Plan:
    """What a scale-down removes and whether the tick drains it first (the module docstring)."""

    leaving_replicas: int  # serving replicas the scale-down removes; 0: none
    how: str = ""  # DELETION_COST or ORDINALS; "": not drained
    removed_by: str = ""  # who picks the pods ("" where not known)
    why_not: str = ""  # a scale-down not drained: why, for the decision


def plan(
    config: dict, observation: Observation | None, *, current_replicas: int, to_replicas: int
) -> Plan:
    """The drain of a scale-down to `to_replicas` (the target; in hpa-bounds mode the new
    maximum of the autoscaler's bounds)."""
    mode = mode_of(config)
    running = observation.spec_replicas if observation is not None else None
    if running is None and mode == "replicas":
        running = current_replicas  # ours: what we last set
    if running is None or running <= to_replicas:
        return Plan(0)
    count = running - to_replicas
    kind = config.get("kind", "Deployment")
    removed_by = _removed_by(kind, observation)
    if mode != "replicas":
        return Plan(count, removed_by=removed_by, why_not=_autoscaled(mode, count))
    if not config.get("pod_selector"):
        return Plan(
            count,
            removed_by=removed_by,
            why_not="No pod_selector: the control plane does not know this workload's pods "
            "by name, so it cannot choose the ones that go; its controller picks them.",
        )
    if removed_by == REPLICA_SET:
        ready = observation.ready_replicas if observation is not None else None
        if ready is not None:
            # Not-ready pods go before any ready one: only the ready pods above the target
            # leave by their deletion cost.
            count = min(count, ready - to_replicas)
            if count <= 0:
                return Plan(0)
        return Plan(count, how=DELETION_COST, removed_by=removed_by)
    if removed_by in _ORDINAL_KINDS:
        return Plan(count, how=ORDINALS, removed_by=removed_by)
    if removed_by == KNATIVE:
        why_not = (
            "KServe Serverless: new bounds are a new Knative revision (KServe writes them into "
            "the Knative Service's revision template), whose pods replace every pod of this "
            "one once ready; no pod of this revision is picked, so none is drained before it."
        )
    elif kind == "InferenceService":
        why_not = (
            "The InferenceService could not be read this tick, so whether a ReplicaSet "
            "(RawDeployment) or Knative (Serverless) removes its pods is not known: none is "
            "drained."
        )
    else:
        why_not = (
            f"Kind {kind}: which pods its controller removes is not known, so none is drained."
        )
    return Plan(count, removed_by=removed_by, why_not=why_not)


def _removed_by(kind: str, observation: Observation | None) -> str:
    if kind == "Deployment":
        return REPLICA_SET
    if kind in _ORDINAL_KINDS:
        return kind
    if kind == "InferenceService" and observation is not None:
        return observation.removed_by or ""
    return ""


def _autoscaled(mode: str, count: int) -> str:
    when = (
        "when it next scales within the new bounds"
        if mode == "hpa-bounds"
        else "as it follows mu_desired_replicas"
    )
    return (
        f"The autoscaler removes {count} replica(s) {when}, in its own time, and the "
        "workload's controller picks the pods. In mode "
        f"{mode} the control plane writes no pod (its Role, deploy/kubernetes/rbac/"
        f"{mode}.yaml, grants no pod patch to lower a deletion cost), so none is drained "
        "first: each leaves the gateways as its pod terminates."
    )


def leaving_pods(drain: Plan, config: dict, replicas: list[Replica]) -> list[Replica]:
    """The serving pods the plan drains, from the deployment's Replica rows."""
    if not drain.how or drain.leaving_replicas <= 0:
        return []
    pods = [
        r
        for r in replicas
        if r.key.startswith("pod:")
        and r.state == Replica.State.HEALTHY
        # A benchmark's replica stays until its run ends (the target includes it).
        and r.held_by_benchmark_run_id is None
    ]
    if drain.how == ORDINALS:
        return sorted(pods, key=lambda r: _ordinal(config, r), reverse=True)[
            : drain.leaving_replicas
        ]
    # Unknown load sorts last: a pod whose engine did not say may be the busiest.
    return sorted(
        pods,
        key=lambda r: (r.running_requests is None, r.running_requests or 0.0, r.key),
    )[: drain.leaving_replicas]


def pod_name(replica: Replica) -> str:
    return replica.key.removeprefix("pod:")


def _ordinal(config: dict, replica: Replica) -> int:
    name = pod_name(replica)
    if config.get("kind") == "LeaderWorkerSet":
        # A group's leader is `<lws>-<group>`, its workers `<lws>-<group>-<worker>`: the group
        # index is the first number after the set's name.
        rest = name.removeprefix(f"{config.get('name', '')}-")
        head = rest.split("-", 1)[0]
        return int(head) if head.isascii() and head.isdigit() else -1
    match = _TRAILING_NUMBER.search(name)
    return int(match.group(1)) if match else -1


def mark_draining(replicas: list[Replica]) -> None:
    Replica.objects.filter(pk__in=[r.pk for r in replicas]).update(state=Replica.State.DRAINING)


def serve_again(replicas: list[Replica]) -> None:
    """The scale-down did not happen: the pods it chose serve again."""
    Replica.objects.filter(pk__in=[r.pk for r in replicas], state=Replica.State.DRAINING).update(
        state=Replica.State.HEALTHY
    )


def serve_survivors(
    deployment: Deployment, *, listed_ready: set[str], ready_replicas: int, now: datetime
) -> list[str]:
    """Draining pods the platform kept serve again (the module docstring); called by the
    health probes with the pods they found ready and not terminating. Returns their keys."""
    survivors = Replica.objects.filter(
        deployment=deployment, state=Replica.State.DRAINING, key__in=listed_ready
    )
    keys = sorted(survivors.values_list("key", flat=True))
    # More ready pods than the target: the scale-down is still under way.
    if not keys or ready_replicas > deployment.current_replicas:
        return []
    since = now - timedelta(seconds=settings.HEALTH_DRAIN_SETTLE_SECONDS)
    recent = AllocationDecision.objects.filter(
        deployment=deployment, created_at__gt=since
    ).values_list("reasons", flat=True)
    if any(reason.get("code") == DRAINED for reasons in recent for reason in reasons or []):
        return []  # a drain younger than the settle time: its controller may not have acted
    survivors.update(state=Replica.State.HEALTHY)
    logger.info(
        "drain: %s kept %s after its scale-down settled: serving again", deployment.name, keys
    )
    return keys
