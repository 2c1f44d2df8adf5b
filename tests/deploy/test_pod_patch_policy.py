"""The scaler's pod patches are held to one annotation (issue 34, finding 16): RBAC cannot
narrow `patch` on pods to a field, so every mode whose Role grants it ships a
ValidatingAdmissionPolicy beside it, and its CEL admits a change of
controller.kubernetes.io/pod-deletion-cost by the scaler and refuses anything else it tries
(an image above all). The expressions are evaluated with cel-python (tests/deploy/
admission_policy.py); the real actuator's patch goes through them in
tests/capacity/actuation/test_pod_patch_policy.py."""

from __future__ import annotations

import copy

import pytest

from capacity.actuation.kubernetes import LEAVING_POD_COST, POD_DELETION_COST, POD_PATCHING_MODES
from tests.deploy import manifests as m
from tests.deploy.admission_policy import admit

SCALER = "system:serviceaccount:controlplane:model-unit-control-plane"
POLICY_KINDS = ("ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding")


def policy_documents(mode: str) -> list[dict]:
    path = m.RBAC_DIR / f"{mode}-pod-patch-policy.yaml"
    return m.load_file(path) if path.exists() else []


def pod_patch_policy(mode: str = "replicas") -> dict:
    (policy,) = [d for d in policy_documents(mode) if d["kind"] == "ValidatingAdmissionPolicy"]
    return policy


def a_pod() -> dict:
    """A vLLM pod as a ReplicaSet makes it, with annotations of its own."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": "llama-8b-h100-7c9d-x2x4q",
            "namespace": "inference",
            "labels": {"app.kubernetes.io/name": "llama-8b-h100", "pod-template-hash": "7c9d"},
            "annotations": {"prometheus.io/scrape": "true"},
            "ownerReferences": [
                {"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": "llama-8b-h100-7c9d",
                 "uid": "0b8d", "controller": True, "blockOwnerDeletion": True}
            ],
            "resourceVersion": "41",
        },
        "spec": {
            "containers": [
                {"name": "vllm", "image": "vllm/vllm-openai:v0.31.0",
                 "args": ["--model=meta-llama/Llama-3.1-8B-Instruct"]}
            ],
        },
    }  # fmt: skip


def changed(pod: dict, change) -> dict:
    new = copy.deepcopy(pod)
    change(new)
    new["metadata"]["resourceVersion"] = "42"  # the server's, on every update: not looked at
    return new


def lower_the_cost(pod: dict) -> None:
    pod["metadata"].setdefault("annotations", {})[POD_DELETION_COST] = LEAVING_POD_COST


def test_every_mode_whose_role_patches_pods_ships_the_policy_and_no_other_mode_does():
    for mode in m.RBAC_MODES:
        patches_pods = "patch" in m.rbac_rules(mode).get(("", "pods"), set())
        assert patches_pods == (mode in POD_PATCHING_MODES), mode
        kinds = sorted(doc["kind"] for doc in policy_documents(mode))
        assert kinds == (list(POLICY_KINDS) if patches_pods else []), mode


def test_the_binding_denies_through_the_policy_and_the_policy_names_the_role_bindings_subject():
    documents = policy_documents("replicas")
    policy = pod_patch_policy()
    (binding,) = [d for d in documents if d["kind"] == "ValidatingAdmissionPolicyBinding"]
    assert binding["spec"] == {
        "policyName": policy["metadata"]["name"],
        "validationActions": ["Deny"],
    }
    assert policy["spec"]["failurePolicy"] == "Fail"
    (role_binding,) = [d for d in m.rbac_documents("replicas") if d["kind"] == "RoleBinding"]
    (subject,) = role_binding["subjects"]
    username = f"system:serviceaccount:{subject['namespace']}:{subject['name']}"
    assert username == SCALER
    assert admit(policy, username=SCALER, old=a_pod(), new=a_pod()).matched
    # The policy text says where it goes and why.
    text = (m.RBAC_DIR / "replicas-pod-patch-policy.yaml").read_text()
    assert "kubectl apply -f deploy/kubernetes/rbac/replicas-pod-patch-policy.yaml" in text
    assert "replicas-pod-patch-policy.yaml" in (m.RBAC_DIR / "replicas.yaml").read_text()


@pytest.mark.parametrize("annotations", [True, False], ids=["with_annotations", "without_any"])
def test_the_scaler_may_lower_a_pods_deletion_cost_and_take_it_off_again(annotations):
    old = a_pod()
    if not annotations:
        del old["metadata"]["annotations"]
    lowered = changed(old, lower_the_cost)
    verdict = admit(pod_patch_policy(), username=SCALER, old=old, new=lowered)
    assert verdict.matched and verdict.allowed, verdict.denials
    restored = changed(lowered, lambda pod: pod["metadata"]["annotations"].pop(POD_DELETION_COST))
    assert admit(pod_patch_policy(), username=SCALER, old=lowered, new=restored).allowed


def _image(pod: dict) -> None:
    pod["spec"]["containers"][0]["image"] = "registry.example/miner:1"


def _args(pod: dict) -> None:
    pod["spec"]["containers"][0]["args"].append("--trust-remote-code")


def _label(pod: dict) -> None:
    pod["metadata"]["labels"]["app.kubernetes.io/name"] = "elsewhere"


def _other_annotation(pod: dict) -> None:
    pod["metadata"]["annotations"]["prometheus.io/scrape"] = "false"


def _drop_annotation(pod: dict) -> None:
    del pod["metadata"]["annotations"]["prometheus.io/scrape"]


def _orphan(pod: dict) -> None:
    del pod["metadata"]["ownerReferences"]


def _finalizer(pod: dict) -> None:
    pod["metadata"]["finalizers"] = ["example.com/hold"]


@pytest.mark.parametrize(
    ("change", "says"),
    [
        (_image, "not its spec"),
        (_args, "not its spec"),
        (_label, "not its labels"),
        (_other_annotation, "no other annotation"),
        (_drop_annotation, "no other annotation"),
        (_orphan, "not its owners or finalizers"),
        (_finalizer, "not its owners or finalizers"),
    ],
)
def test_the_scaler_may_change_nothing_else_on_a_pod(change, says):
    old = a_pod()
    # Even beside the annotation it may change: the whole update is refused.
    new = changed(old, lambda pod: (lower_the_cost(pod), change(pod)))
    verdict = admit(pod_patch_policy(), username=SCALER, old=old, new=new)
    assert verdict.matched
    assert len(verdict.denials) == 1 and says in verdict.denials[0], verdict.denials


def test_nobody_else_is_held_to_it_and_it_looks_at_pod_updates_only():
    old = a_pod()
    new = changed(old, _image)
    policy = pod_patch_policy()
    for username in ("kubernetes-admin", "system:serviceaccount:kube-system:replicaset-controller",
                     "system:serviceaccount:other:model-unit-control-plane"):  # fmt: skip
        assert not admit(policy, username=username, old=old, new=new).matched, username
    assert not admit(policy, username=SCALER, old=old, new=None, operation="DELETE").matched
    assert not admit(
        policy, username=SCALER, old=old, new=new, resource=("apps", "v1", "deployments")
    ).matched
