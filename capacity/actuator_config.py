"""What each actuator kind needs in `Deployment.actuator_config`, checked before it is stored.

Secrets never go in the config: a webhook's signing secret or a Kubernetes token is named by
the environment variable that holds it (`secret_env`, `token_env`).
"""

import re
from urllib.parse import urlsplit

from rest_framework import serializers

from capacity.models import ActuatorKind
from controlplane.errors import DomainError

_ENV_NAME = re.compile(r"^[A-Z_][A-Z0-9_]*$")
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$")
_API_VERSION = re.compile(r"^v[1-9][0-9]*((alpha|beta)[1-9][0-9]*)?$")

KUBERNETES_KINDS = ("Deployment", "StatefulSet", "Custom")
KUBERNETES_DEFAULT_TIMEOUT_SECONDS = 5.0


def _env_name(value: str) -> str:
    if not _ENV_NAME.match(value):
        raise serializers.ValidationError(
            "must name an environment variable (upper case letters, digits, underscores)."
        )
    return value


class _StrictSerializer(serializers.Serializer):
    """Refuses keys it does not know, so a typo does not silently fall back to a default."""

    def to_internal_value(self, data):
        if not isinstance(data, dict):
            raise serializers.ValidationError({"non_field_errors": ["must be a JSON object."]})
        unknown = sorted(set(data) - set(self.fields))
        value = super().to_internal_value(data)
        if unknown:
            raise serializers.ValidationError(
                {key: ["is not a setting of this actuator kind."] for key in unknown}
            )
        return value


class DryRunConfig(_StrictSerializer):
    pass


class KubernetesConfig(_StrictSerializer):
    """Which object's scale subresource to patch, and how to reach the API server.

    The API server is `api_server` (with a bearer token from `token_env`), else the cluster in
    the `kubeconfig` file, else the in-cluster service account.
    """

    namespace = serializers.RegexField(
        _DNS_LABEL, max_length=63, error_messages={"invalid": "must be a DNS label."}
    )
    name = serializers.RegexField(
        _DNS_SUBDOMAIN, max_length=253, error_messages={"invalid": "must be a DNS subdomain name."}
    )
    kind = serializers.ChoiceField(
        choices=KUBERNETES_KINDS,
        default="Deployment",
        help_text="Custom: any resource with a scale subresource, named by group/version/plural.",
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
    api_server = serializers.URLField(
        required=False,
        help_text="Empty: the cluster of `kubeconfig`, else the in-cluster service account.",
    )
    kubeconfig = serializers.CharField(
        required=False, max_length=4096, help_text="Path of a kubeconfig file; its current context."
    )
    token_env = serializers.CharField(
        required=False,
        validators=[_env_name],
        help_text="Environment variable holding the bearer token for `api_server`.",
    )
    verify_tls = serializers.BooleanField(default=True)
    # Not defaulted into the stored config, so configs written before it existed stay equal
    # to what is stored now; the actuator applies KUBERNETES_DEFAULT_TIMEOUT_SECONDS.
    timeout_seconds = serializers.FloatField(
        required=False,
        min_value=0.1,
        max_value=60.0,
        help_text=f"Per API request; default {KUBERNETES_DEFAULT_TIMEOUT_SECONDS:g}.",
    )

    # Health probes (capacity.health) reach each pod; without a selector they probe the
    # deployment's endpoint_url as a whole and cannot restart one pod.
    pod_selector = serializers.CharField(
        required=False,
        max_length=1000,
        help_text="Label selector of the engine pods, e.g. app=llama-8b; enables per-pod probes.",
    )
    pod_port = serializers.IntegerField(
        required=False, min_value=1, max_value=65535, help_text="The engines' port (default 8000)."
    )

    def validate(self, attrs):
        errors: dict[str, list[str]] = {}
        custom_fields = ("group", "version", "plural")
        if attrs.get("kind") == "Custom":
            for key in custom_fields:
                if key not in attrs:
                    errors[key] = ["is required for kind Custom."]
        else:
            for key in custom_fields:
                if key in attrs:
                    errors[key] = ["applies only to kind Custom."]
        api_server = attrs.get("api_server")
        if api_server and urlsplit(api_server).scheme not in ("http", "https"):
            errors["api_server"] = ["must be an http or https URL."]
        if api_server and attrs.get("kubeconfig"):
            errors["kubeconfig"] = ["give either api_server or kubeconfig, not both."]
        if "token_env" in attrs and not api_server:
            # A kubeconfig carries its own credentials and in-cluster uses the service account.
            errors["token_env"] = ["applies only with api_server."]
        if errors:
            raise serializers.ValidationError(errors)
        return attrs


class WebhookConfig(_StrictSerializer):
    url = serializers.URLField()
    secret_env = serializers.CharField(
        required=False,
        validators=[_env_name],
        help_text="Environment variable holding the HMAC signing secret.",
    )
    timeout_seconds = serializers.FloatField(
        default=5.0, min_value=0.1, max_value=60.0, help_text="Per request, connect and read."
    )

    def validate_url(self, value: str) -> str:
        if urlsplit(value).scheme not in ("http", "https"):
            raise serializers.ValidationError("must be an http or https URL.")
        return value


class ProcessConfig(_StrictSerializer):
    """Engine processes on one host, run by `manage.py run_process_supervisor` on that host.

    Replica i runs `command` with "{port}" replaced by `base_port + i` and "{replica}" by i;
    the control plane reaches the supervisor at `supervisor_url` and sends it this whole
    config, so the supervisor needs no database.
    """

    command = serializers.ListField(
        child=serializers.CharField(),
        allow_empty=False,
        help_text=(
            'argv of one engine process; "{port}" becomes the replica\'s port, "{replica}" its '
            "index (0, 1, …)."
        ),
    )
    host = serializers.CharField(
        default="127.0.0.1", help_text="Where the engines answer, for health and drain checks."
    )
    base_port = serializers.IntegerField(min_value=1024, max_value=65535)
    # A CharField: URLField refuses the bare host names (`http://gpu-07:8190`) of a GPU LAN.
    supervisor_url = serializers.CharField(
        default="http://127.0.0.1:8190",
        max_length=2000,
        help_text="Base URL of `manage.py run_process_supervisor` on the engines' host.",
    )
    drain_seconds = serializers.FloatField(
        default=30.0,
        min_value=0.0,
        max_value=3600.0,
        help_text="How long a removed replica may finish its in-flight requests before a kill.",
    )
    token_env = serializers.CharField(
        required=False,
        validators=[_env_name],
        help_text="Environment variable holding the supervisor's bearer token.",
    )

    def validate_command(self, value: list[str]) -> list[str]:
        # Without the placeholder every replica would try the same port and all but one crash.
        if not any("{port}" in arg for arg in value):
            raise serializers.ValidationError(
                'must contain "{port}" in one argument, so that each replica listens on its own '
                'port (e.g. ["vllm", "serve", "MODEL", "--port", "{port}"]).'
            )
        return value

    def validate_supervisor_url(self, value: str) -> str:
        parts = urlsplit(value)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise serializers.ValidationError(
                "must be an http or https URL with a host, e.g. http://gpu-07:8190."
            )
        return value


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


def validate_actuator_config(kind: str, config) -> dict:
    """The config with defaults filled in, or a DomainError naming `actuator_config.<field>`."""
    schema = SCHEMAS.get(kind)
    if schema is None:
        raise DomainError(
            f"Unknown actuator kind '{kind}'. Known: {', '.join(SCHEMAS)}.", field="actuator_kind"
        )
    serializer = schema(data=config if config is not None else {})
    if not serializer.is_valid():
        fields = _flatten("actuator_config", serializer.errors)
        first_field, reasons = next(iter(fields.items()))
        raise DomainError(
            f"{first_field}: {reasons[0]} (actuator kind '{kind}')",
            field=first_field,
            fields=fields,
        )
    return dict(serializer.validated_data)
