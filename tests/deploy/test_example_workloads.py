"""Every example workload in deploy/kubernetes/examples/ runs as a non-root user without
privileges, on a pinned image (issue 34, finding 16: the vLLM examples ran as root with
`:latest`), and a vLLM server running as that user can write where vLLM writes."""

from __future__ import annotations

import re

import pytest

from tests.deploy import manifests as m
from tests.deploy.test_kubernetes_manifests import example_pod_specs

DIGEST = re.compile(r"^sha256:[0-9a-f]{64}$")


def _pinned(image: str) -> bool:
    """Whether an image reference names a release tag (not `latest`) or a digest. The tag is
    after the last path segment's colon: a registry's port is not one."""
    name, _, digest = image.partition("@")
    last = name.rsplit("/", 1)[-1]
    tag = last.partition(":")[2]
    if digest:
        return DIGEST.match(digest) is not None and tag != "latest"
    return bool(tag) and tag != "latest"


@pytest.mark.parametrize(
    ("image", "pinned"),
    [
        ("vllm/vllm-openai:v0.31.0", True),
        ("vllm/vllm-openai:v0.31.0@sha256:" + "a" * 64, True),
        ("vllm/vllm-openai@sha256:" + "b" * 64, True),
        ("vllm/vllm-openai:latest", False),
        ("vllm/vllm-openai", False),
        ("registry.example:5000/vllm", False),  # a port, not a tag
        ("registry.example:5000/vllm:v1.2", True),
        ("vllm/vllm-openai:latest@sha256:" + "c" * 64, False),
    ],
)
def test_a_pinned_image_names_a_release_or_a_digest(image, pinned):
    assert _pinned(image) is pinned


def test_the_walk_finds_every_example_pod():
    found = {where.split(":")[0] for where, _, _ in example_pod_specs()}
    assert found >= {
        "vllm-deployment.yaml",
        "leaderworkerset.yaml",
        "kserve-rawdeployment.yaml",
        "kserve-serverless.yaml",
    }


def test_every_example_pod_runs_as_a_non_root_user_without_privileges():
    for where, spec, pod_containers in example_pod_specs():
        pod = spec.get("securityContext", {})
        assert pod.get("runAsNonRoot") is True, f"{where}: no runAsNonRoot"
        # A numeric user: with a named USER in the image, the kubelet cannot check it is not
        # root and refuses to start the pod.
        assert isinstance(pod.get("runAsUser"), int) and pod["runAsUser"] > 0, where
        assert pod.get("seccompProfile", {}).get("type") == "RuntimeDefault", where
        for container in pod_containers:
            context = container.get("securityContext", {})
            assert context.get("runAsUser", pod["runAsUser"]) != 0, where
            assert context.get("runAsNonRoot", True) is True, where
            assert context.get("allowPrivilegeEscalation") is False, where
            assert context.get("privileged", False) is False, where
            assert context.get("capabilities", {}).get("drop") == ["ALL"], where
            assert not context.get("capabilities", {}).get("add"), where


def test_every_example_image_is_pinned_never_latest():
    images = 0
    for where, _, pod_containers in example_pod_specs():
        for container in pod_containers:
            if "image" not in container:
                # A KServe model container: its ServingRuntime names the image.
                assert "InferenceService" in where, f"{where}: a container with no image"
                continue
            images += 1
            assert _pinned(container["image"]), f"{where}: {container['image']} is not pinned"
    assert images >= 3


def test_every_vllm_container_writes_its_home_and_weights_to_volumes_not_to_root():
    checked = 0
    for where, spec, pod_containers in example_pod_specs():
        volumes = {volume["name"] for volume in spec.get("volumes", [])}
        for container in pod_containers:
            if not container.get("image", "").startswith("vllm/vllm-openai"):
                continue
            checked += 1
            env = {entry["name"]: entry.get("value") for entry in container.get("env", [])}
            mounts = {
                mount["mountPath"]: mount["name"] for mount in container.get("volumeMounts", [])
            }
            assert not [path for path in mounts if path.startswith("/root")], where
            assert env.get("USER"), f"{where}: PyTorch's getpass.getuser() needs USER"
            assert set(mounts.values()) <= volumes, where
            # HF_HOME unset: the weights go under HOME, on its volume too.
            for variable in ("HOME", "HF_HOME"):
                path = env.get(variable) or env.get("HOME")
                assert path, f"{where}: no HOME"
                on_volume = any(path == at or path.startswith(at + "/") for at in mounts)
                assert on_volume, f"{where}: {variable}={path} is on no volume"
    assert checked >= 3


def test_the_kserve_examples_run_as_the_runtime_images_own_user():
    # kserve/huggingfaceserver: `useradd kserve -u 1000` and `USER 1000`.
    for name in ("kserve-rawdeployment.yaml", "kserve-serverless.yaml"):
        (isvc,) = m.load_file(m.EXAMPLES_DIR / name)
        assert isvc["spec"]["predictor"]["securityContext"]["runAsUser"] == 1000, name
