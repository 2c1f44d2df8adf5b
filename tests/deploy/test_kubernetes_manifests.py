"""deploy/kubernetes/ renders, validates offline against the Kubernetes and CRD schemas, and
holds what a reviewer of a deployment checks: probes, resources, a non-root read-only
container, one beat, the migrations, secrets only by reference, least-privilege RBAC, network
policies that let each part reach what it needs and nothing else it does not."""

from __future__ import annotations

import re
import secrets
import shutil
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import pytest
from django.conf import settings

from tests.controlplane.test_settings import run_manage
from tests.deploy import manifests as m

BASE = m.KUBERNETES_DIR / "base"
RENDERED = [BASE, *m.overlays()]
PRODUCTION = m.KUBERNETES_DIR / "overlays" / "production"
SERVICE_ACCOUNT = "model-unit-control-plane"
SCALER_ROLE = "model-unit-control-plane-scaler"
WRITE_VERBS = {"create", "update", "patch", "delete", "deletecollection", "*"}
# Variables whose values are credentials (or carry one, as a URL with a password does).
SECRET_NAME = re.compile(r"SECRET|PASSWORD|TOKEN|_KEY$|DATABASE_URL|REDIS_URL")
WORKLOAD_KINDS = {"Deployment", "StatefulSet", "DaemonSet", "Job"}


def rendered_id(directory: Path) -> str:
    return str(directory.relative_to(m.KUBERNETES_DIR))


def of_kind(objects: list[dict], kind: str) -> list[dict]:
    return [obj for obj in objects if obj["kind"] == kind]


def named(objects: list[dict], kind: str, name: str) -> dict:
    found = [obj for obj in of_kind(objects, kind) if obj["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind} {name}: {len(found)} found"
    return found[0]


def workloads(objects: list[dict]) -> list[dict]:
    return [obj for obj in objects if obj["kind"] in WORKLOAD_KINDS]


def pod_spec(workload: dict) -> dict:
    return workload["spec"]["template"]["spec"]


def pod_labels(workload: dict) -> dict:
    return workload["spec"]["template"]["metadata"].get("labels", {})


def containers(spec: dict) -> list[dict]:
    return [*spec.get("initContainers", []), *spec.get("containers", [])]


def config_map(objects: list[dict], prefix: str) -> dict[str, str]:
    # configMapGenerator appends a hash of the content to the name.
    found = [
        obj for obj in of_kind(objects, "ConfigMap") if obj["metadata"]["name"].startswith(prefix)
    ]
    assert len(found) == 1, prefix
    return found[0]["data"]


def environment(objects: list[dict], container: dict) -> dict[str, Any]:
    """The container's variables: a ConfigMap's value, or the env entry itself."""
    env: dict[str, Any] = {}
    for source in container.get("envFrom", []):
        name = source["configMapRef"]["name"]
        env |= named(objects, "ConfigMap", name)["data"]
    for entry in container.get("env", []):
        env[entry["name"]] = entry.get("value", entry.get("valueFrom"))
    return env


def argv(container: dict) -> str:
    return " ".join([*container.get("command", []), *container.get("args", [])])


def option(container: dict, name: str) -> str | None:
    found = re.search(rf"{name}[= ](\S+)", argv(container))
    return found.group(1) if found else None


def pre_stop_seconds(container: dict) -> int:
    pre_stop = container.get("lifecycle", {}).get("preStop", {})
    if "sleep" in pre_stop:
        return int(pre_stop["sleep"]["seconds"])
    assert not pre_stop, f"{container['name']}: a preStop other than sleep"
    return 0


def selects(selector: dict, labels: dict) -> bool:
    """A label selector's verdict (matchLabels and matchExpressions)."""
    if any(labels.get(key) != value for key, value in selector.get("matchLabels", {}).items()):
        return False
    for expression in selector.get("matchExpressions", []):
        key, operator, values = expression["key"], expression["operator"], expression.get("values")
        if operator == "In" and labels.get(key) not in values:
            return False
        if operator == "NotIn" and labels.get(key) in values:
            return False
        if operator == "Exists" and key not in labels:
            return False
        if operator == "DoesNotExist" and key in labels:
            return False
    return True


@pytest.fixture(scope="module", params=RENDERED, ids=rendered_id)
def rendered(request) -> list[dict]:
    return m.render(request.param)


@pytest.fixture(scope="module")
def production() -> list[dict]:
    return m.render(PRODUCTION)


# --- Rendering and schemas --------------------------------------------------------------------


def test_there_is_an_overlay_to_render():
    assert PRODUCTION in m.overlays()


def test_every_rendered_object_validates_against_the_kubernetes_schemas(rendered):
    assert rendered
    found = [problem for obj in rendered for problem in m.problems(obj)]
    assert not found, "\n".join(found)


@pytest.mark.parametrize(
    "path",
    sorted(m.EXAMPLES_DIR.glob("*.yaml")) + sorted(m.RBAC_DIR.glob("*.yaml")),
    ids=lambda path: f"{path.parent.name}/{path.name}",
)
def test_every_example_and_rbac_file_validates(path):
    objects = m.load_file(path)
    assert objects, path
    found = [problem for obj in objects for problem in m.problems(obj)]
    assert not found, "\n".join(found)


def test_the_examples_cover_keda_an_hpa_kserve_lws_and_vllm():
    kinds = {obj["kind"] for path in m.EXAMPLES_DIR.glob("*.yaml") for obj in m.load_file(path)}
    assert {
        "ScaledObject",
        "HorizontalPodAutoscaler",
        "InferenceService",
        "LeaderWorkerSet",
        "Deployment",
    } <= kinds
    # The custom resources are checked against the vendored CRDs, not skipped.
    for kind in ("ScaledObject", "InferenceService", "LeaderWorkerSet", "ServiceMonitor"):
        assert any(known == kind for _, known in m.crd_validators()), kind


def broken_base(tmp_path: Path, patch: str) -> list[dict]:
    """A copy of the base rendered with one JSON patch on web's Deployment."""
    shutil.copytree(BASE, tmp_path / "base")
    overlay = tmp_path / "broken"
    overlay.mkdir()
    (overlay / "kustomization.yaml").write_text(
        "resources:\n  - ../base\n"
        "patches:\n"
        "  - target: {kind: Deployment, name: controlplane-web}\n"
        "    patch: |\n" + "".join(f"      {line}\n" for line in patch.splitlines())
    )
    return m.render(overlay)


def test_a_wrong_type_fails_validation_naming_the_field(tmp_path):
    objects = broken_base(tmp_path, "- op: replace\n  path: /spec/replicas\n  value: two")
    found = m.problems(named(objects, "Deployment", "controlplane-web"))
    assert found and "spec.replicas" in found[0] and "'two'" in found[0], found


def test_an_unknown_field_fails_validation_naming_it(tmp_path):
    objects = broken_base(
        tmp_path,
        "- op: add\n  path: /spec/template/spec/terminationGracePeriod\n  value: 30",
    )
    found = m.problems(named(objects, "Deployment", "controlplane-web"))
    assert found and "terminationGracePeriod" in found[0], found


def test_an_unknown_field_of_a_custom_resource_fails_validation_naming_it():
    scaled_object = m.load_file(m.EXAMPLES_DIR / "keda-scaledobject.yaml")[0]
    assert not m.problems(scaled_object)
    scaled_object["spec"]["minReplicas"] = scaled_object["spec"].pop("minReplicaCount")
    found = m.problems(scaled_object)
    assert found and "minReplicas" in found[0], found
    worker = m.load_file(m.EXAMPLES_DIR / "leaderworkerset.yaml")[0]["spec"]
    worker["leaderWorkerTemplate"]["workerTemplate"]["spec"]["containers"][0]["resources"] = "8"
    found = m.problems(
        {
            "apiVersion": "leaderworkerset.x-k8s.io/v1",
            "kind": "LeaderWorkerSet",
            "metadata": {"name": "x"},
            "spec": worker,
        }
    )
    assert found and "workerTemplate.spec.containers.0.resources" in found[0], found


# --- Pods -------------------------------------------------------------------------------------


def test_every_container_has_requests_and_limits(rendered):
    for workload in workloads(rendered):
        for container in containers(pod_spec(workload)):
            resources = container.get("resources", {})
            for kind in ("requests", "limits"):
                assert {"cpu", "memory"} <= set(resources.get(kind, {})), (
                    f"{workload['metadata']['name']}/{container['name']}: {kind}"
                )


def test_every_container_with_a_port_has_readiness_and_liveness_probes_on_it(rendered):
    served = 0
    for workload in workloads(rendered):
        for container in pod_spec(workload)["containers"]:
            ports = {port.get("name") for port in container.get("ports", [])} | {
                port["containerPort"] for port in container.get("ports", [])
            }
            if not container.get("ports"):
                continue
            served += 1
            for probe in ("readinessProbe", "livenessProbe"):
                assert probe in container, f"{container['name']}: no {probe}"
                assert container[probe]["httpGet"]["port"] in ports, (container["name"], probe)
    assert served >= 2  # web and the gateway


def test_every_pod_runs_as_the_images_non_root_user_without_privileges(rendered):
    user = re.search(r"^USER (\d+):(\d+)$", (m.ROOT / "deploy" / "Dockerfile").read_text(), re.M)
    assert user, "the Dockerfile names no numeric USER"
    for workload in workloads(rendered):
        spec = pod_spec(workload)
        pod = spec["securityContext"]
        assert pod["runAsNonRoot"] is True
        assert (pod["runAsUser"], pod["runAsGroup"]) == (int(user[1]), int(user[2]))
        assert pod["seccompProfile"]["type"] == "RuntimeDefault"
        mounts_of = {volume["name"]: volume for volume in spec.get("volumes", [])}
        for container in containers(spec):
            context = container["securityContext"]
            assert context["allowPrivilegeEscalation"] is False
            assert context["capabilities"]["drop"] == ["ALL"]
            assert context["readOnlyRootFilesystem"] is True
            # Python, gunicorn and the gateway's metrics need a writable /tmp.
            tmp = [
                mount for mount in container.get("volumeMounts", []) if mount["mountPath"] == "/tmp"
            ]
            assert tmp and "emptyDir" in mounts_of[tmp[0]["name"]], container["name"]


def test_one_image_runs_every_part_and_production_pins_it(production):
    images = {c["image"] for w in workloads(production) for c in containers(pod_spec(w))}
    assert len(images) == 1, images
    (image,) = images
    assert ":" in image and not image.endswith(":latest"), image


def test_beat_runs_exactly_once(rendered):
    beats = [
        w
        for w in workloads(rendered)
        for c in pod_spec(w)["containers"]
        if re.search(r"\bcelery\b.*\bbeat\b", argv(c))
    ]
    assert len(beats) == 1
    (beat,) = beats
    assert beat["kind"] == "Deployment"
    assert beat["spec"]["replicas"] == 1
    # A rolling update would run the old and the new beat together for a moment.
    assert beat["spec"]["strategy"]["type"] == "Recreate"
    assert not [
        pdb
        for pdb in of_kind(rendered, "PodDisruptionBudget")
        if selects(pdb["spec"]["selector"], pod_labels(beat))
    ]


def test_a_job_runs_the_migrations_and_the_apps_wait_for_it(rendered):
    jobs = [
        job
        for job in of_kind(rendered, "Job")
        if any("manage.py migrate" in argv(c) for c in pod_spec(job)["containers"])
    ]
    assert len(jobs) == 1
    assert "setup_periodic_tasks" in argv(pod_spec(jobs[0])["containers"][0])
    for workload in of_kind(rendered, "Deployment"):
        uses_database = any(
            "DATABASE_URL" in environment(rendered, c) for c in pod_spec(workload)["containers"]
        )
        waits = any(
            "migrate --check" in argv(c) for c in pod_spec(workload).get("initContainers", [])
        )
        assert waits == uses_database, workload["metadata"]["name"]


def test_every_celery_queue_is_consumed_by_a_worker(rendered):
    consumed: set[str] = set()
    for workload in workloads(rendered):
        for container in pod_spec(workload)["containers"]:
            if re.search(r"\bcelery\b.*\bworker\b", argv(container)):
                queues = option(container, "--queues")
                assert queues, container["name"]
                consumed |= set(queues.split(","))
                # Celery's default is the node's CPU count, not the pod's share.
                assert option(container, "--concurrency"), container["name"]
    declared = {queue.name for queue in settings.CELERY_TASK_QUEUES}
    assert declared <= consumed, f"no worker consumes {sorted(declared - consumed)}"


def test_web_and_gateway_have_a_service_and_a_disruption_budget(rendered):
    for component in ("web", "gateway"):
        name = f"controlplane-{component}"
        workload = named(rendered, "Deployment", name)
        labels = pod_labels(workload)
        service = named(rendered, "Service", name)
        assert selects({"matchLabels": service["spec"]["selector"]}, labels)
        port_names = {p["name"] for p in pod_spec(workload)["containers"][0]["ports"]}
        assert {p["targetPort"] for p in service["spec"]["ports"]} <= port_names
        budgets = [
            pdb
            for pdb in of_kind(rendered, "PodDisruptionBudget")
            if selects(pdb["spec"]["selector"], labels)
        ]
        assert len(budgets) == 1, name
        # A budget that allows no disruption at the replicas run would block every drain.
        budget = budgets[0]["spec"]
        allowed = budget.get(
            "maxUnavailable", workload["spec"]["replicas"] - budget.get("minAvailable", 0)
        )
        assert 1 <= allowed < workload["spec"]["replicas"], name


def test_production_runs_web_and_gateway_on_several_replicas(production):
    for name in ("controlplane-web", "controlplane-gateway"):
        assert named(production, "Deployment", name)["spec"]["replicas"] >= 3


def test_grace_periods_outlast_the_preStop_sleep_and_the_processes_own_drain(rendered):
    web = named(rendered, "Deployment", "controlplane-web")
    container = pod_spec(web)["containers"][0]
    drain = int(option(container, "--graceful-timeout") or 30)  # gunicorn's default
    assert pod_spec(web)["terminationGracePeriodSeconds"] > pre_stop_seconds(container) + drain
    from dataplane.gateway.runner import JOIN_AFTER_GRACE_SECONDS
    from dataplane.gateway.settings import Settings

    gateway = named(rendered, "Deployment", "controlplane-gateway")
    container = pod_spec(gateway)["containers"][0]
    env = config_map(rendered, "controlplane-gateway-settings")
    grace = float(env.get("GATEWAY_SHUTDOWN_GRACE_SECONDS", Settings.shutdown_grace_seconds))
    needed = pre_stop_seconds(container) + grace + JOIN_AFTER_GRACE_SECONDS
    assert pod_spec(gateway)["terminationGracePeriodSeconds"] > needed


# --- How the parts find each other ------------------------------------------------------------


def test_probes_and_the_gateway_name_a_host_django_allows(rendered):
    allowed = config_map(rendered, "controlplane-settings")["ALLOWED_HOSTS"].split(",")
    web = named(rendered, "Deployment", "controlplane-web")
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        headers = pod_spec(web)["containers"][0][probe]["httpGet"].get("httpHeaders", [])
        # Without one the kubelet sends the pod's IP, which Django answers with 400.
        hosts = [h["value"] for h in headers if h["name"].lower() == "host"]
        assert hosts and hosts[0] in allowed, (probe, hosts)
    url = urlparse(
        config_map(rendered, "controlplane-gateway-settings")["GATEWAY_CONTROL_PLANE_URL"]
    )
    assert url.hostname in allowed
    service = named(rendered, "Service", url.hostname)
    assert url.port in {port["port"] for port in service["spec"]["ports"]}
    assert selects({"matchLabels": service["spec"]["selector"]}, pod_labels(web))


def test_the_gateway_listens_on_the_pod_address_and_port_it_declares(rendered):
    env = config_map(rendered, "controlplane-gateway-settings")
    gateway = named(rendered, "Deployment", "controlplane-gateway")
    container = pod_spec(gateway)["containers"][0]
    assert env["GATEWAY_HOST"] == "0.0.0.0"
    assert [int(env["GATEWAY_PORT"])] == [p["containerPort"] for p in container["ports"]]
    # One event loop per core (dataplane/README.md): no more workers than the pod's cores.
    assert int(env["GATEWAY_WORKERS"]) <= int(container["resources"]["limits"]["cpu"])


def test_the_admission_fallback_is_shared_by_every_web_process(rendered):
    """While Redis is down each gunicorn worker admits 1/ADMISSION_FALLBACK_PROCESSES of a
    reservation: the fleet must count every web process, or it admits more than was sold."""
    web = named(rendered, "Deployment", "controlplane-web")
    workers = int(option(pod_spec(web)["containers"][0], "--workers"))
    processes = int(config_map(rendered, "controlplane-settings")["ADMISSION_FALLBACK_PROCESSES"])
    assert processes == web["spec"]["replicas"] * workers


@pytest.mark.slow
def test_the_settings_pass_djangos_deployment_checks_but_the_redirect(production):
    """The ConfigMap's values load (a malformed one fails the start) and pass `check --deploy`,
    except the HTTPS redirect, which the Ingress does instead of Django."""
    env = dict(config_map(production, "controlplane-settings"))
    env |= {
        "SECRET_KEY": secrets.token_urlsafe(50),
        "DATABASE_URL": "postgres://controlplane:x@postgres.example:5432/controlplane",
        "REDIS_URL": "redis://redis.example:6379/0",
    }
    result = run_manage("check", "--deploy", **env)
    assert result.returncode == 0, result.stdout + result.stderr
    assert set(re.findall(r"\((\w+\.\w+)\)", result.stdout + result.stderr)) == {"security.W008"}
    for ingress in of_kind(production, "Ingress"):
        annotations = ingress["metadata"]["annotations"]
        assert annotations["nginx.ingress.kubernetes.io/force-ssl-redirect"] == "true"
        assert ingress["spec"]["tls"]


# --- Secrets ----------------------------------------------------------------------------------


def secret_references(objects: list[dict]) -> set[tuple[str, str]]:
    references = set()
    for workload in workloads(objects):
        for container in containers(pod_spec(workload)):
            for entry in container.get("env", []):
                ref = entry.get("valueFrom", {}).get("secretKeyRef")
                if ref:
                    references.add((ref["name"], ref["key"]))
            assert not [s for s in container.get("envFrom", []) if "secretRef" in s]
    return references


def test_no_secret_value_is_in_the_manifests(rendered):
    assert not of_kind(rendered, "Secret")
    for config in of_kind(rendered, "ConfigMap"):
        leaked = [key for key in config["data"] if SECRET_NAME.search(key)]
        assert not leaked, (config["metadata"]["name"], leaked)
    for workload in workloads(rendered):
        for container in containers(pod_spec(workload)):
            for entry in container.get("env", []):
                if SECRET_NAME.search(entry["name"]):
                    assert "secretKeyRef" in entry.get("valueFrom", {}), entry["name"]
    assert secret_references(rendered)


def test_every_secret_key_the_pods_read_is_in_the_documented_create_command(rendered):
    readme = (m.ROOT / "deploy" / "README.md").read_text()
    for name, key in secret_references(rendered):
        command = re.search(
            rf"kubectl [^\n]*create secret generic {re.escape(name)}\b(.*?)(?:\n\n|```)",
            readme,
            re.S,
        )
        assert command, f"deploy/README.md: no `kubectl create secret generic {name}`"
        assert re.search(rf"--from-literal={key}=", command[1]), (name, key)


def test_the_gateway_gets_neither_the_database_nor_djangos_key(rendered):
    gateway = named(rendered, "Deployment", "controlplane-gateway")
    env = environment(rendered, pod_spec(gateway)["containers"][0])
    assert not {"DATABASE_URL", "SECRET_KEY", "REDIS_URL"} & set(env)


# --- What the Ingress publishes, and how Prometheus scrapes ------------------------------------

# Web's paths that only the cluster uses: the kubelet's probes and Prometheus's scrape.
INTERNAL_PATHS = {"/metrics", "/healthz", "/readyz"}


def _segments(path: str) -> list[str]:
    return [part for part in path.split("/") if part]


def ingress_routes(ingress: dict, path: str) -> bool:
    """Whether the Ingress sends `path` to a backend, by the API's path types: Exact matches
    the path alone, Prefix element by element ("/api" matches "/api/v1/", not "/apiary")."""
    for rule in ingress["spec"]["rules"]:
        for route in rule.get("http", {}).get("paths", []):
            if route["pathType"] == "Exact" and route["path"] == path:
                return True
            if route["pathType"] == "Prefix":
                prefix = _segments(route["path"])
                if _segments(path)[: len(prefix)] == prefix:
                    return True
    return False


def web_paths() -> set[str]:
    """The first path of every route of the URL conf, and the static files'."""
    from controlplane.urls import urlpatterns

    return {"/" + str(pattern.pattern) for pattern in urlpatterns} | {"/" + settings.STATIC_URL}


def test_the_ingress_publishes_every_page_and_the_api_but_not_metrics_or_the_probes(production):
    """Issue 34: the Ingress routed `/` to web, so /metrics was public. It now routes what
    people and clients use, by name; a new top-level path must be added to it (or here)."""
    paths = web_paths()
    assert paths >= INTERNAL_PATHS
    for ingress in of_kind(production, "Ingress"):
        for path in sorted(INTERNAL_PATHS):
            assert not ingress_routes(ingress, path), (ingress["metadata"]["name"], path)
    web_ingress = named(production, "Ingress", "controlplane-web")
    for path in sorted(paths - INTERNAL_PATHS):
        assert ingress_routes(web_ingress, path), path
        # Below a page (a prefix), everything is routed; the bare "/" redirects, nothing more.
        assert ingress_routes(web_ingress, path + "anything/below") == (path != "/"), path


def test_prometheus_scrapes_web_with_the_token_web_reads_from_the_same_secret(production):
    """The ServiceMonitor example selects web's Service and sends the METRICS_TOKEN web's pods
    read, from a Secret of its own (Prometheus's operator reads it, so it holds nothing else)."""
    web = named(production, "Deployment", "controlplane-web")
    token = next(
        entry["valueFrom"]["secretKeyRef"]
        for entry in pod_spec(web)["containers"][0]["env"]
        if entry["name"] == "METRICS_TOKEN"
    )
    assert token["name"] != "controlplane-secrets"
    (monitor,) = example("prometheus-servicemonitor.yaml")
    assert monitor["kind"] == "ServiceMonitor"
    service = named(production, "Service", "controlplane-web")
    assert selects(monitor["spec"]["selector"], service["metadata"].get("labels", {}))
    # The operator reads the Secret in the ServiceMonitor's own namespace: web's.
    assert monitor["metadata"]["namespace"] == web["metadata"]["namespace"]
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["port"] in {port["name"] for port in service["spec"]["ports"]}
    assert endpoint["path"] == "/metrics"
    assert endpoint["authorization"]["type"] == "Bearer"
    credentials = endpoint["authorization"]["credentials"]
    assert (credentials["name"], credentials["key"]) == (token["name"], token["key"])
    # And the network lets Prometheus in.
    labels = pod_labels(web)
    assert Policies(production).ingress(labels, 8000, from_namespace="monitoring", named_as="http")


# --- Service accounts and RBAC ----------------------------------------------------------------


def test_only_the_workers_get_a_kubernetes_api_token(rendered):
    named(rendered, "ServiceAccount", SERVICE_ACCOUNT)
    with_token = set()
    for workload in workloads(rendered):
        spec = pod_spec(workload)
        if spec.get("serviceAccountName") == SERVICE_ACCOUNT:
            with_token.add(pod_labels(workload)["app.kubernetes.io/component"])
        else:
            assert spec.get("automountServiceAccountToken") is False, workload["metadata"]["name"]
    assert with_token == {"worker", "loop-worker", "health-worker"}


def test_no_cluster_wide_rbac_anywhere(rendered):
    everything = rendered + [obj for mode in m.RBAC_MODES for obj in m.rbac_documents(mode)]
    assert not [obj for obj in everything if obj["kind"] in {"ClusterRole", "ClusterRoleBinding"}]


@pytest.mark.parametrize("mode", m.RBAC_MODES)
def test_each_mode_binds_the_scaler_role_to_the_base_service_account(mode, production):
    documents = m.rbac_documents(mode)
    assert sorted(doc["kind"] for doc in documents) == ["Role", "RoleBinding"]
    for doc in documents:
        # `kubectl apply -n <workloads namespace>` decides where they go.
        assert "namespace" not in doc["metadata"]
        assert doc["metadata"]["name"] == SCALER_ROLE
    binding = next(doc for doc in documents if doc["kind"] == "RoleBinding")
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "Role",
        "name": SCALER_ROLE,
    }
    account = named(production, "ServiceAccount", SERVICE_ACCOUNT)
    assert binding["subjects"] == [
        {
            "kind": "ServiceAccount",
            "name": SERVICE_ACCOUNT,
            "namespace": account["metadata"]["namespace"],
        }
    ]
    assert (m.RBAC_DIR / f"{mode}.yaml").read_text().startswith("# RBAC for actuator mode")


def test_no_mode_grants_a_wildcard_or_a_write_beyond_what_it_scales():
    may_write = {
        "replicas": {
            ("apps", "deployments/scale"),
            ("apps", "statefulsets/scale"),
            ("leaderworkerset.x-k8s.io", "leaderworkersets/scale"),
            ("serving.kserve.io", "inferenceservices"),
            ("", "pods"),
        },
        "hpa-bounds": {
            ("autoscaling", "horizontalpodautoscalers"),
            # An InferenceService's own minReplicas/maxReplicas are its HPA's bounds.
            ("serving.kserve.io", "inferenceservices"),
            ("", "pods"),
        },
        "metric": set(),
    }
    for mode in m.RBAC_MODES:
        rules = m.rbac_rules(mode)
        assert rules
        for (group, resource), verbs in rules.items():
            assert "*" not in verbs and "*" not in (group, resource), (mode, resource)
            if verbs & WRITE_VERBS:
                assert (group, resource) in may_write[mode], (mode, group, resource, verbs)
                assert not verbs & {"create", "update", "deletecollection"}, (mode, resource)


# Which verbs each mode grants, exactly, is checked against the verbs the control plane
# really calls (recorded by the fake API server): tests/capacity/actuation/test_rbac.py.


def test_the_old_rbac_file_points_at_the_new_ones():
    text = (m.ROOT / "deploy" / "rbac.yaml").read_text()
    assert not m.load_all(text), "deploy/rbac.yaml should hold no objects any more"
    assert "deploy/kubernetes/rbac/" in text


# --- Network policies -------------------------------------------------------------------------


class Policies:
    """The namespace's NetworkPolicies, asked what they let one pod do."""

    def __init__(self, objects: list[dict]):
        self.policies = [p["spec"] for p in of_kind(objects, "NetworkPolicy")]

    def _rules(self, labels: dict, direction: str) -> list[dict]:
        key = "egress" if direction == "Egress" else "ingress"
        return [
            rule
            for policy in self.policies
            if direction in policy.get("policyTypes", []) and selects(policy["podSelector"], labels)
            for rule in policy.get(key, [])
        ]

    @staticmethod
    def _port_matches(rule: dict, port: int | str, named_as: str | None, protocol: str) -> bool:
        ports = rule.get("ports")
        if not ports:
            return True
        return any(
            p.get("protocol", "TCP") == protocol and p.get("port") in (port, named_as)
            for p in ports
        )

    @staticmethod
    def _peer_matches(rule: dict, key: str, pod: dict | None, namespace: str | None) -> bool:
        peers = rule.get(key)
        if not peers:
            return True  # any destination
        for peer in peers:
            if "ipBlock" in peer:
                continue
            namespace_ok = (
                "namespaceSelector" not in peer
                if namespace is None
                else "namespaceSelector" in peer
                and selects(peer["namespaceSelector"], {"kubernetes.io/metadata.name": namespace})
            )
            pod_ok = "podSelector" not in peer or (
                pod is not None and selects(peer["podSelector"], pod)
            )
            if namespace_ok and pod_ok:
                return True
        return False

    def egress(
        self, labels, port, *, to_pod=None, to_namespace=None, named_as=None, protocol="TCP"
    ):
        return any(
            self._port_matches(rule, port, named_as, protocol)
            and self._peer_matches(rule, "to", to_pod, to_namespace)
            for rule in self._rules(labels, "Egress")
        )

    def ingress(self, labels, port, *, from_pod=None, from_namespace=None, named_as=None):
        return any(
            self._port_matches(rule, port, named_as, "TCP")
            and self._peer_matches(rule, "from", from_pod, from_namespace)
            for rule in self._rules(labels, "Ingress")
        )


def test_network_policies_deny_by_default(rendered):
    policies = Policies(rendered).policies
    assert any(
        p["podSelector"] == {}
        and set(p["policyTypes"]) == {"Ingress", "Egress"}
        and not p.get("ingress")
        and not p.get("egress")
        for p in policies
    )


def test_network_policies_let_each_part_reach_what_it_uses_and_no_more(rendered):
    policies = Policies(rendered)
    web = named(rendered, "Deployment", "controlplane-web")
    web_port = pod_spec(web)["containers"][0]["ports"][0]
    dns = {"k8s-app": "kube-dns"}
    for workload in workloads(rendered):
        labels = pod_labels(workload)
        name = workload["metadata"]["name"]
        env: dict[str, Any] = {}
        for container in pod_spec(workload)["containers"]:
            env |= environment(rendered, container)
        assert policies.egress(
            labels, 53, to_pod=dns, to_namespace="kube-system", protocol="UDP"
        ), name
        assert policies.egress(labels, 5432) == ("DATABASE_URL" in env), name
        uses_redis = "REDIS_URL" in env or "GATEWAY_REDIS_URL" in env
        # Redis in its own namespace, and nowhere else on its port (issue 34: a pod that
        # reaches Redis can try its passwords).
        assert policies.egress(labels, 6379, to_namespace="redis", to_pod={}) == uses_redis, name
        assert not policies.egress(labels, 6379, to_namespace="default", to_pod={}), name
        assert not policies.egress(labels, 6379), name
        actuator = pod_spec(workload).get("serviceAccountName") == SERVICE_ACCOUNT
        assert policies.egress(labels, 443) == actuator, name
        talks_to_web = "GATEWAY_CONTROL_PLANE_URL" in env
        assert (
            policies.egress(
                labels, web_port["containerPort"], to_pod=pod_labels(web), named_as=web_port["name"]
            )
            == talks_to_web
        ), name
        serves = [p for c in pod_spec(workload)["containers"] for p in c.get("ports", [])]
        for port in serves:
            assert policies.ingress(
                labels, port["containerPort"], from_namespace="ingress-nginx", named_as=port["name"]
            ), name
        if not serves:
            assert not policies._rules(labels, "Ingress"), (
                f"{name} serves nothing yet takes ingress"
            )
    gateway = named(rendered, "Deployment", "controlplane-gateway")
    assert policies.ingress(
        pod_labels(web), web_port["containerPort"], from_pod=pod_labels(gateway), named_as="http"
    )
    assert policies.egress(pod_labels(gateway), 8000, to_namespace="inference", to_pod={})


# --- Examples ---------------------------------------------------------------------------------


def example(name: str) -> list[dict]:
    return m.load_file(m.EXAMPLES_DIR / name)


def example_pod_specs() -> list[tuple[str, dict, list[dict]]]:
    """(where, pod-level fields, containers) of every pod an example runs."""
    found = []
    for path in sorted(m.EXAMPLES_DIR.glob("*.yaml")):
        for obj in m.load_file(path):
            where = f"{path.name}: {obj['kind']} {obj['metadata']['name']}"
            if obj["kind"] in WORKLOAD_KINDS:
                spec = pod_spec(obj)
                found.append((where, spec, spec["containers"]))
            elif obj["kind"] == "LeaderWorkerSet":
                template = obj["spec"]["leaderWorkerTemplate"]
                for part in ("leaderTemplate", "workerTemplate"):
                    if part in template:
                        spec = template[part]["spec"]
                        found.append((f"{where} {part}", spec, spec["containers"]))
            elif obj["kind"] == "InferenceService":
                predictor = obj["spec"]["predictor"]
                found.append((where, predictor, [predictor["model"]]))
    return found


def test_every_vllm_server_drains_streams_within_its_grace_period():
    servers = 0
    for where, spec, pod_containers in example_pod_specs():
        for container in pod_containers:
            text = argv(container)
            serves = "vllm serve" in text or "--model_id" in text or "--model=" in text
            if not serves:
                continue
            servers += 1
            drain = option(container, "--shutdown-timeout")
            # Without it vLLM aborts every request in flight on SIGTERM.
            assert drain, f"{where}: no --shutdown-timeout"
            needed = pre_stop_seconds(container) + int(drain)
            assert spec["terminationGracePeriodSeconds"] > needed, where
    assert servers >= 4


def test_every_example_container_has_resources():
    for where, _, pod_containers in example_pod_specs():
        for container in pod_containers:
            assert container.get("resources", {}).get("requests"), where
            assert container["resources"].get("limits"), where


def test_the_autoscaler_examples_read_the_target_deployments_own_gauge():
    (scaled_object,) = example("keda-scaledobject.yaml")
    (trigger,) = scaled_object["spec"]["triggers"]
    target = scaled_object["spec"]["scaleTargetRef"]["name"]
    assert trigger["type"] == "prometheus"
    assert trigger["metadata"]["query"] == f'max(mu_desired_replicas{{deployment="{target}"}})'
    # desired = ceil(gauge / 1): the gauge itself. A Value target would multiply it by the
    # replicas already running.
    assert trigger["metricType"] == "AverageValue" and trigger["metadata"]["threshold"] == "1"
    (hpa,) = example("hpa-external-metric.yaml")
    (metric,) = hpa["spec"]["metrics"]
    assert metric["external"]["metric"]["name"] == "mu_desired_replicas"
    assert metric["external"]["metric"]["selector"]["matchLabels"] == {
        "deployment": hpa["spec"]["scaleTargetRef"]["name"]
    }
    assert metric["external"]["target"] == {"type": "AverageValue", "averageValue": "1"}
    for behavior in (
        scaled_object["spec"]["advanced"]["horizontalPodAutoscalerConfig"]["behavior"],
        hpa["spec"]["behavior"],
    ):
        # The control plane stabilises already; a second window would lag behind it.
        assert behavior["scaleDown"]["stabilizationWindowSeconds"] == 0


def test_the_kserve_examples_leave_scaling_to_the_control_plane_or_knative():
    (raw,) = example("kserve-rawdeployment.yaml")
    annotations = raw["metadata"]["annotations"]
    assert annotations["serving.kserve.io/deploymentMode"] == "RawDeployment"
    assert annotations["serving.kserve.io/autoscalerClass"] == "external"
    (serverless,) = example("kserve-serverless.yaml")
    assert serverless["metadata"]["annotations"]["serving.kserve.io/deploymentMode"] == "Serverless"
    for isvc in (raw, serverless):
        predictor = isvc["spec"]["predictor"]
        assert predictor["minReplicas"] <= predictor["maxReplicas"]
