"""Which replicas a Kubernetes scale-down removes, chosen before it happens.

Left alone, a ReplicaSet picks the pods to delete itself, so a pod serving long streams can be
the one killed. Before a scale-down the tick picks the pods that should go and:

- for ReplicaSet-backed workloads (a Deployment; a KServe predictor Deployment under an
  external autoscaler) the least loaded pods, by the requests their engine had running at the
  last probe (`Replica.running_requests`, the engine's own vllm:num_requests_running); the
  actuator lowers their `controller.kubernetes.io/pod-deletion-cost`, which only the ReplicaSet
  controller honours, before it patches the scale;
- for StatefulSets and LeaderWorkerSets the highest ordinals (they always remove those);

and marks them `draining` (`Replica.State.DRAINING`) and republishes the gateways' documents,
so gateways route nothing new to them while their engines finish what they serve (vLLM
finishes in-flight requests on SIGTERM within the pod's terminationGracePeriodSeconds:
deploy/README.md). If the push fails they are serving again at once.

Pods are known by their Replica rows (`pod:<name>`), so this needs the deployment's
`pod_selector`; without one the ReplicaSet picks.
"""

from __future__ import annotations

import re

from capacity.models import Replica

_ORDINAL_KINDS = ("StatefulSet", "LeaderWorkerSet")
_TRAILING_NUMBER = re.compile(r"-(\d+)$")


def leaving_pods(config: dict, replicas: list[Replica], count: int) -> list[Replica]:
    """The `count` serving pods to remove first, from the deployment's Replica rows."""
    if count <= 0:
        return []
    pods = [
        r
        for r in replicas
        if r.key.startswith("pod:")
        and r.state == Replica.State.HEALTHY
        # A benchmark's replica stays until its run ends (the target includes it).
        and r.held_by_benchmark_run_id is None
    ]
    kind = config.get("kind", "Deployment")
    if kind in _ORDINAL_KINDS:
        return sorted(pods, key=lambda r: _ordinal(config, r), reverse=True)[:count]
    if kind == "Custom":
        return []  # no way to know which pods its controller removes
    # Unknown load sorts last: a pod whose engine did not say may be the busiest.
    return sorted(
        pods,
        key=lambda r: (r.running_requests is None, r.running_requests or 0.0, r.key),
    )[:count]


def pod_name(replica: Replica) -> str:
    return replica.key.removeprefix("pod:")


def _ordinal(config: dict, replica: Replica) -> int:
    name = pod_name(replica)
    if config.get("kind") == "LeaderWorkerSet":
        # A group's leader is `<lws>-<group>`, its workers `<lws>-<group>-<worker>`: the group
        # index is the first number after the set's name.
        rest = name.removeprefix(f"{config.get('name', '')}-")
        head = rest.split("-", 1)[0]
        return int(head) if head.isdigit() else -1
    match = _TRAILING_NUMBER.search(name)
    return int(match.group(1)) if match else -1


def mark_draining(replicas: list[Replica]) -> None:
    Replica.objects.filter(pk__in=[r.pk for r in replicas]).update(state=Replica.State.DRAINING)


def serve_again(replicas: list[Replica]) -> None:
    """The scale-down did not happen: the pods it chose serve again."""
    Replica.objects.filter(pk__in=[r.pk for r in replicas], state=Replica.State.DRAINING).update(
        state=Replica.State.HEALTHY
    )
