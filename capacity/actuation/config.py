"""What each actuator kind needs in `Deployment.actuator_config`, checked before it is stored.

The config only chooses among what the operator allowed (docs/design.md#trust; core/outbound.py):

- secrets are named by the environment variable that holds them (`secret_env`, `token_env`),
  and only variables of ACTUATOR_SECRET_ENV_NAMES may be named; each is sent only to the
  destination ACTUATOR_SECRET_DESTINATIONS binds it to (refused with the code
  `secret_not_for_destination`, naming the field and the destination);
- hosts (a webhook's `url`, a supervisor's `supervisor_url`, engines' `host`) must be allowed by
  OUTBOUND_ALLOWED_HOSTS;
- a Kubernetes cluster is a profile of KUBERNETES_CLUSTERS, picked by name (`cluster`);
- an engine process is a name (`engine`) the process supervisor's own allow-list maps to a
  command.

Keys that used to carry these (api_server, token_env and kubeconfig of Kubernetes, a process's
command) are refused with a message that says where they went.
"""

import re
from urllib.parse import urlsplit

from django.conf import settings
from rest_framework import serializers

from capacity.models import ActuatorKind
from core import outbound
from core.errors import DomainError

ENGINE_NAME = re.compile(r"^[a-z0-9][a-z0-9_.-]{0,62}$")
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$")
_API_VERSION = re.compile(r"^v[1-9][0-9]*((alpha|beta)[1-9][0-9]*)?$")

KUBERNETES_KINDS = ("Deployment", "StatefulSet", "LeaderWorkerSet", "InferenceService", "Custom")
# How the control plane acts on the cluster (capacity/actuation/kubernetes.py): it owns the
# replicas; it sets the bounds of an HPA that owns them; or it only publishes what it wants
# (`mu_desired_replicas` on /metrics) for a KEDA ScaledObject or an HPA to act on.
KUBERNETES_MODES = ("replicas", "hpa-bounds", "metric")
# KServe's InferenceService CRD declares a status subresource and no scale subresource
# (config/crd/full/serving.kserve.io_inferenceservices.yaml; deploy/kubernetes/crds/).
_NO_SCALE_SUBRESOURCE = {("serving.kserve.io", "inferenceservices")}
KUBERNETES_DEFAULT_TIMEOUT_SECONDS = 5.0
DEFAULT_CLUSTER = "in-cluster"
# The API's error code for a secret named for a destination it is not bound to.
SECRET_NOT_FOR_DESTINATION = "secret_not_for_destination"
# A host name or an IP address (IPv6 without brackets): it also goes into engines' argv.
_HOST = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9.:%_-]{0,252})$")


def _secret_env(value: str) -> str:
    refusal = outbound.secret_env_refusal_from_settings(value)
    if refusal:
        raise serializers.ValidationError(refusal)
    return value


def _secret_destination(attrs: dict, *, field: str, kind: str, url: str) -> None:
    """Refuses a secret the operator did not bind to `url`: allowing a host is not allowing
    every secret to go there. Not skipped at apply time (it resolves nothing)."""
    name = attrs.get(field)
    if not name:
        return
    refusal = outbound.secret_destination_refusal_from_settings(name, kind=kind, url=url)
    if refusal:
        raise serializers.ValidationError({field: [refusal]}, code=SECRET_NOT_FOR_DESTINATION)


def _check_url(serializer: serializers.Serializer, value: str) -> str:
    """Refuses a URL the control plane may not reach (skipped at apply time, see below)."""
    if serializer.context.get("check_hosts", True):
        try:
            outbound.check_url(value, purpose=outbound.OUTBOUND)
        except DomainError as error:
            raise serializers.ValidationError(error.message) from error
    return value


class _StrictSerializer(serializers.Serializer):
    """Refuses keys it does not know, so a typo does not silently fall back to a default."""

    # Keys that were settings of this kind once and are now the operator's: why, and where to.
    moved_to_operator: dict[str, str] = {}

    def to_internal_value(self, data):
        if not isinstance(data, dict):
            raise serializers.ValidationError({"non_field_errors": ["must be a JSON object."]})
        unknown = sorted(set(data) - set(self.fields))
        moved = {
            key: [self.moved_to_operator[key]] for key in unknown if key in self.moved_to_operator
        }
        if moved:
            # Said first and alone: the fix is a different config, not a corrected value.
            raise serializers.ValidationError(moved)
        value = super().to_internal_value(data)
        if unknown:
            raise serializers.ValidationError(
                {key: ["is not a setting of this actuator kind."] for key in unknown}
            )
        return value


class DryRunConfig(_StrictSerializer):
    pass


_CLUSTER_MOVED = (
    "is an operator setting now: pick a cluster profile of KUBERNETES_CLUSTERS by name in "
    "`cluster`."
)


def _cluster_names() -> str:
    return ", ".join(sorted(settings.KUBERNETES_CLUSTERS)) or "none"


class KubernetesConfig(_StrictSerializer):
    """Which object's scale subresource to patch, in which of the operator's clusters.

    `cluster` names a profile of the KUBERNETES_CLUSTERS setting (a kubeconfig file, an API
    server with a token, or the in-cluster service account); the API never says how to reach
    a cluster or with which credentials.
    """

    moved_to_operator = {
        "api_server": _CLUSTER_MOVED,
        "token_env": _CLUSTER_MOVED,
        "kubeconfig": _CLUSTER_MOVED,
        "verify_tls": _CLUSTER_MOVED,
    }

    namespace = serializers.RegexField(
        _DNS_LABEL, max_length=63, error_messages={"invalid": "must be a DNS label."}
    )
    name = serializers.RegexField(
        _DNS_SUBDOMAIN, max_length=253, error_messages={"invalid": "must be a DNS subdomain name."}
    )
    kind = serializers.ChoiceField(
        choices=KUBERNETES_KINDS,
        default="Deployment",
        help_text=(
            "InferenceService: KServe's, through spec.predictor.minReplicas/maxReplicas (it has "
            "no scale subresource). Custom: any resource with a scale subresource, named by "
            "group/version/plural."
        ),
    )
    # Not defaulted into the stored config (as timeout_seconds below): absent means replicas.
    mode = serializers.ChoiceField(
        choices=KUBERNETES_MODES,
        required=False,
        help_text=(
            "replicas: the control plane sets the replicas; hpa-bounds: it sets the bounds of "
            "the HPA named in hpa_name (an InferenceService's own minReplicas/maxReplicas); "
            "metric: it writes nothing and publishes mu_desired_replicas on /metrics."
        ),
    )
    hpa_name = serializers.RegexField(
        _DNS_SUBDOMAIN,
        max_length=253,
        required=False,
        error_messages={"invalid": "must be a DNS subdomain name."},
        help_text="hpa-bounds mode: the HorizontalPodAutoscaler (autoscaling/v2) to bound.",
    )
    group = serializers.RegexField(
        _DNS_SUBDOMAIN,
        max_length=253,
        required=False,
        error_messages={"invalid": "must be an API group such as serving.kserve.io."},
        help_text="Custom only, e.g. serving.kserve.io or leaderworkerset.x-k8s.io.",
    )
    version = serializers.RegexField(
        _API_VERSION,
        required=False,
        error_messages={"invalid": "must be an API version such as v1 or v1beta1."},
        help_text="Custom only, e.g. v1beta1.",
    )
    plural = serializers.RegexField(
        _DNS_LABEL,
        max_length=63,
        required=False,
        error_messages={"invalid": "must be a resource's plural name such as inferenceservices."},
        help_text="Custom only, e.g. inferenceservices or leaderworkersets.",
    )
    cluster = serializers.CharField(
        default=DEFAULT_CLUSTER,
        max_length=63,
        help_text="A cluster profile of the KUBERNETES_CLUSTERS setting (default: in-cluster).",
    )
    # Not defaulted into the stored config, so configs written before it existed stay equal
    # to what is stored now; the actuator applies KUBERNETES_DEFAULT_TIMEOUT_SECONDS.
    timeout_seconds = serializers.FloatField(
        required=False,
        min_value=0.1,
        max_value=60.0,
        help_text=f"Per API request; default {KUBERNETES_DEFAULT_TIMEOUT_SECONDS:g}.",
    )

    # Health probes (capacity.health.probes) reach each pod; without a selector they probe the
    # deployment's endpoint_url as a whole and cannot restart one pod.
    pod_selector = serializers.CharField(
        required=False,
        max_length=1000,
        help_text="Label selector of the engine pods, e.g. app=llama-8b; enables per-pod probes.",
    )
    pod_port = serializers.IntegerField(
        required=False, min_value=1, max_value=65535, help_text="The engines' port (default 8000)."
    )

    def validate_cluster(self, value: str) -> str:
        if value not in settings.KUBERNETES_CLUSTERS:
            raise serializers.ValidationError(
                f"'{value}' is not a cluster profile of the KUBERNETES_CLUSTERS setting "
                f"(known: {_cluster_names()})."
            )
        return value

    def validate(self, attrs):
        errors: dict[str, list[str]] = {}
        custom_fields = ("group", "version", "plural")
        kind = attrs.get("kind")
        if kind == "Custom":
            for key in custom_fields:
                if key not in attrs:
                    errors[key] = ["is required for kind Custom."]
            if (attrs.get("group"), attrs.get("plural")) in _NO_SCALE_SUBRESOURCE:
                errors["kind"] = [
                    "KServe's InferenceService has no scale subresource: use kind "
                    "InferenceService, which sets spec.predictor.minReplicas/maxReplicas."
                ]
        else:
            for key in custom_fields:
                if key in attrs:
                    errors[key] = ["applies only to kind Custom."]
        mode = attrs.get("mode", "replicas")
        if mode == "hpa-bounds" and kind != "InferenceService" and "hpa_name" not in attrs:
            errors["hpa_name"] = ["is required in mode hpa-bounds (the HPA whose bounds to set)."]
        if "hpa_name" in attrs and (mode != "hpa-bounds" or kind == "InferenceService"):
            errors["hpa_name"] = [
                "applies only to mode hpa-bounds on a kind other than InferenceService "
                "(an InferenceService's bounds are its own minReplicas/maxReplicas)."
            ]
        if errors:
            raise serializers.ValidationError(errors)
        return attrs


class WebhookConfig(_StrictSerializer):
    """A URL of the operator's allow-list, signed with a secret of an allowed variable."""

    url = serializers.URLField(help_text="Must be allowed by OUTBOUND_ALLOWED_HOSTS.")
    secret_env = serializers.CharField(
        required=False,
        validators=[_secret_env],
        help_text=(
            "Environment variable holding the HMAC signing secret; one of "
            "ACTUATOR_SECRET_ENV_NAMES, bound to this URL's host by ACTUATOR_SECRET_DESTINATIONS. "
            "Required unless ACTUATOR_ALLOW_UNSIGNED_WEBHOOKS."
        ),
    )
    timeout_seconds = serializers.FloatField(
        default=5.0, min_value=0.1, max_value=60.0, help_text="Per request, connect and read."
    )

    def validate_url(self, value: str) -> str:
        if urlsplit(value).scheme not in ("http", "https"):
            raise serializers.ValidationError("must be an http or https URL.")
        return _check_url(self, value)

    def validate(self, attrs):
        if not attrs.get("secret_env") and not settings.ACTUATOR_ALLOW_UNSIGNED_WEBHOOKS:
            # Unsigned, anyone who can reach the receiver can scale the deployment.
            raise serializers.ValidationError(
                {
                    "secret_env": [
                        "is required: webhooks are signed unless the operator setting "
                        "ACTUATOR_ALLOW_UNSIGNED_WEBHOOKS is on."
                    ]
                }
            )
        _secret_destination(attrs, field="secret_env", kind=outbound.WEBHOOK, url=attrs["url"])
        return attrs


class ProcessConfig(_StrictSerializer):
    """Engine processes on one host, run by `python -m dataplane.supervisor` on that host.

    `engine` names one of the supervisor's own engines (`--engine NAME='argv…'`); replica i
    runs that command with "{port}" = `base_port + i`. The control plane reaches the supervisor
    at `supervisor_url` and sends it these parameters, never a command, so the supervisor needs
    no database.
    """

    moved_to_operator = {
        "command": (
            "is the process supervisor's own setting now: start it with "
            "`python -m dataplane.supervisor --engine NAME='argv with {port}'` and name the "
            "engine in `engine`."
        )
    }

    engine = serializers.RegexField(
        ENGINE_NAME,
        error_messages={
            "invalid": "must be an engine name of the process supervisor (a-z, 0-9, '.', '_', '-')."
        },
        help_text=(
            "An engine of the supervisor's allow-list (python -m dataplane.supervisor --engine)."
        ),
    )
    host = serializers.CharField(
        default="127.0.0.1",
        max_length=253,
        help_text=(
            "Where the engines answer, for health and drain checks; must be allowed by "
            "OUTBOUND_ALLOWED_HOSTS."
        ),
    )
    base_port = serializers.IntegerField(min_value=1024, max_value=65535)
    # A CharField: URLField refuses the bare host names (`http://gpu-07:8190`) of a GPU LAN.
    supervisor_url = serializers.CharField(
        default="http://127.0.0.1:8190",
        max_length=2000,
        help_text=(
            "Base URL of `python -m dataplane.supervisor` on the engines' host; must be allowed "
            "by OUTBOUND_ALLOWED_HOSTS."
        ),
    )
    drain_seconds = serializers.FloatField(
        default=30.0,
        min_value=0.0,
        max_value=3600.0,
        help_text="How long a removed replica may finish its in-flight requests before a kill.",
    )
    token_env = serializers.CharField(
        required=False,
        validators=[_secret_env],
        help_text="Environment variable holding the supervisor's bearer token; one of "
        "ACTUATOR_SECRET_ENV_NAMES, bound to this supervisor by ACTUATOR_SECRET_DESTINATIONS.",
    )

    def validate_host(self, value: str) -> str:
        if not _HOST.match(value):
            raise serializers.ValidationError("must be a host name or an IP address.")
        if self.context.get("check_hosts", True):
            try:
                outbound.check_host(value, purpose=outbound.OUTBOUND)
            except DomainError as error:
                raise serializers.ValidationError(error.message) from error
        return value

    def validate_supervisor_url(self, value: str) -> str:
        parts = urlsplit(value)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise serializers.ValidationError(
                "must be an http or https URL with a host, e.g. http://gpu-07:8190."
            )
        return _check_url(self, value)

    def validate(self, attrs):
        _secret_destination(
            attrs, field="token_env", kind=outbound.SUPERVISOR, url=attrs["supervisor_url"]
        )
        return attrs


SCHEMAS: dict[str, type[_StrictSerializer]] = {
    ActuatorKind.DRY_RUN: DryRunConfig,
    ActuatorKind.KUBERNETES: KubernetesConfig,
    ActuatorKind.WEBHOOK: WebhookConfig,
    ActuatorKind.PROCESS: ProcessConfig,
}


def _flatten(prefix: str, detail) -> dict[str, list[str]]:
    if isinstance(detail, dict):
        out: dict[str, list[str]] = {}
        for key, value in detail.items():
            path = prefix if key == "non_field_errors" else f"{prefix}.{key}"
            for sub, reasons in _flatten(path, value).items():
                out.setdefault(sub, []).extend(reasons)
        return out
    if isinstance(detail, list) and all(not isinstance(item, dict | list) for item in detail):
        return {prefix: [str(item) for item in detail]}
    if isinstance(detail, list):
        out = {}
        for index, item in enumerate(detail):
            for sub, reasons in _flatten(f"{prefix}.{index}", item).items():
                out.setdefault(sub, []).extend(reasons)
        return out
    return {prefix: [str(detail)]}


def _first_code(detail) -> str | None:
    """The code of the first error `_flatten` lists (DRF keeps one on each ErrorDetail)."""
    if isinstance(detail, dict):
        detail = list(detail.values())
    if isinstance(detail, list):
        for item in detail:
            code = _first_code(item)
            if code is not None:
                return code
        return None
    return getattr(detail, "code", None)


def validate_actuator_config(kind: str, config, *, check_hosts: bool = True) -> dict:
    """The config with defaults filled in, or a DomainError naming `actuator_config.<field>`.

    `check_hosts=False` leaves out the reachability check of hosts (which resolves names):
    actuators re-validate at apply time, where the guarded client checks the address it
    actually connects to, and a resolver hiccup should stay a transient failure.
    """
    schema = SCHEMAS.get(kind)
    if schema is None:
        raise DomainError(
            f"Unknown actuator kind '{kind}'. Known: {', '.join(SCHEMAS)}.", field="actuator_kind"
        )
    serializer = schema(
        data=config if config is not None else {}, context={"check_hosts": check_hosts}
    )
    if not serializer.is_valid():
        fields = _flatten("actuator_config", serializer.errors)
        first_field, reasons = next(iter(fields.items()))
        code = _first_code(serializer.errors)
        raise DomainError(
            f"{first_field}: {reasons[0]} (actuator kind '{kind}')",
            field=first_field,
            fields=fields,
            code=code if code == SECRET_NOT_FOR_DESTINATION else "invalid",
        )
    return dict(serializer.validated_data)


def actuator_config_problem(kind: str, config) -> str:
    """Why a stored config breaks the current rules (hosts resolved and checked), or "".

    Every field at fault is named, not only the first: whoever fixes the row should not have
    to save it again to learn of the next problem."""
    try:
        validate_actuator_config(kind, config)
    except DomainError as error:
        if len(error.fields) <= 1:
            return error.message
        reasons = "; ".join(f"{name}: {' '.join(why)}" for name, why in error.fields.items())
        return f"{reasons} (actuator kind '{kind}')"
    return ""


def without_legacy_no_ops(kind: str, config):
    """`config` less the keys of old schemas that never had an effect, so they flag nothing.

    Kubernetes configs stored `verify_tls: true` by default; it applied only with `api_server`,
    which is now a cluster profile's, so without one it is dropped.
    """
    if (
        kind == ActuatorKind.KUBERNETES
        and isinstance(config, dict)
        and "verify_tls" in config
        and "api_server" not in config
    ):
        return {key: value for key, value in config.items() if key != "verify_tls"}
    return config
