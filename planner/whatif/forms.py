"""The what-if form: types and ranges here, everything else in simulation.whatif (whose
DomainError names the field, which the view puts back on the form)."""

from typing import Any

from django import forms
from django.core.files.uploadedfile import UploadedFile

from capacity.models import Deployment, ServedModel
from simulation import whatif
from simulation.engine.compare import known_policies

POLICY_HELP = {
    "static-peak": "the trace's peak, always on (the reference; always simulated)",
    "kpa": "Knative's concurrency autoscaler",
    "hpa-rps": "Kubernetes HPA on requests/s",
    "oracle": "knows the future: a lower bound, not a real option",
    "modelunit": "this control plane's allocation policy (with prediction, as a model has it by "
    "default)",
    "modelunit-reactive": "the same policy with prediction off (a model switched off)",
    "modelunit-clairvoyant": "the policy told the next cold start's demand exactly: a limit, not "
    "a real option",
    "static-slo": "the cheapest static fleet that keeps the SLO, found by search (a few runs)",
    "oracle-slo": "knows the future: the fewest replicas at the SLO, a reference, not a real "
    "option (costs about three policies' runs)",
}


def _limits(field: str) -> dict[str, Any]:
    """The number input's bounds of a field: simulation.whatif's limits, which it checks."""
    default, low, high, exclusive = whatif.LIMITS[field]
    attrs = {"max": high, "step": "any"}
    if not exclusive:
        attrs["min"] = low
    return attrs


# Django's form fields are not subscriptable at run time: the base stays bare.
class DeploymentChoiceField(forms.ModelChoiceField):  # type: ignore[type-arg]
    """A deployment, labelled with its model and its GPUs per replica."""

    def label_from_instance(self, obj: Deployment) -> str:
        return (
            f"{obj.name} ({obj.served_model.name} on {obj.gpu_pool.gpu_type.name}"
            f"×{obj.gpus_per_replica})"
        )


class WhatIfForm(forms.Form):
    """A what-if's trace, fleet and settings, and the policies it compares."""

    served_model = forms.ModelChoiceField(
        queryset=ServedModel.objects.order_by("name"),
        required=False,
        empty_label="(none: the built-in profile)",
        label="Model",
    )
    deployment = DeploymentChoiceField(
        queryset=Deployment.objects.select_related("served_model", "gpu_pool__gpu_type").order_by(
            "served_model__name", "name"
        ),
        required=False,
        empty_label="(every deployment of the model)",
        label="Deployment",
    )
    model_config = forms.CharField(
        required=False,
        label="…or a replica profile instead (model config JSON)",
        widget=forms.Textarea(
            attrs={"rows": 3, "cols": 44, "placeholder": '{"name": "70b", "max_num_seqs": 128}'}
        ),
    )
    trace = forms.ChoiceField(
        choices=[
            *((name, trace.label) for name, trace in whatif.BUNDLED_TRACES.items()),
            (whatif.USAGE_TRACE, whatif.USAGE_LABEL),
        ],
        initial=whatif.DEFAULT_TRACE,
        label="Trace",
    )
    usage_days = forms.IntegerField(
        required=False,
        initial=whatif.LIMITS["usage_days"][0],
        label="…its usage of the last (days)",
        widget=forms.NumberInput(attrs=_limits("usage_days") | {"step": 1}),
    )
    trace_file = forms.FileField(required=False, label="…or upload a CSV (≤ 5 MB)")
    duration_minutes = forms.IntegerField(
        initial=whatif.LIMITS["duration_minutes"][0],
        label="Simulate the first (minutes)",
        widget=forms.NumberInput(attrs=_limits("duration_minutes") | {"step": 1}),
    )
    rate_scale = forms.FloatField(
        initial=whatif.LIMITS["rate_scale"][0],
        label="Demand × (rate scale)",
        widget=forms.NumberInput(attrs=_limits("rate_scale")),
    )
    reservations = forms.CharField(
        required=False,
        label="Reservations (one 'client = MU/min' a line)",
        widget=forms.Textarea(attrs={"rows": 4, "cols": 30, "placeholder": "default = 600"}),
    )
    overcommit = forms.FloatField(
        initial=whatif.LIMITS["overcommit"][0],
        label="Overcommit",
        widget=forms.NumberInput(attrs=_limits("overcommit")),
    )
    keep_warm = forms.BooleanField(required=False, label="Keep one replica warm")
    target_utilisation = forms.FloatField(
        initial=whatif.LIMITS["target_utilisation"][0],
        label="Target utilisation",
        widget=forms.NumberInput(attrs=_limits("target_utilisation")),
    )
    cold_start_seconds = forms.FloatField(
        required=False,
        label="Cold start (s; blank: the profile's)",
        widget=forms.NumberInput(attrs=_limits("cold_start_seconds")),
    )
    slo_ttft_ms = forms.FloatField(
        initial=whatif.LIMITS["slo_ttft_ms"][0],
        label="SLO: TTFT ≤ (ms)",
        widget=forms.NumberInput(attrs=_limits("slo_ttft_ms")),
    )
    slo_goal = forms.FloatField(
        initial=whatif.LIMITS["slo_goal"][0],
        label="…for this share of requests",
        widget=forms.NumberInput(attrs=_limits("slo_goal")),
    )
    tick_seconds = forms.FloatField(
        initial=whatif.LIMITS["tick_seconds"][0],
        label="Autoscaler tick (s)",
        widget=forms.NumberInput(attrs=_limits("tick_seconds")),
    )
    policies = forms.MultipleChoiceField(
        choices=[(name, f"{name} — {POLICY_HELP.get(name, '')}") for name in known_policies()],
        initial=list(whatif.DEFAULT_POLICIES),
        widget=forms.CheckboxSelectMultiple,
        label="Policies",
    )

    def clean_trace_file(self) -> "UploadedFile[bytes] | None":
        """The uploaded trace, refused above simulation.whatif.MAX_UPLOAD_BYTES."""
        upload = self.cleaned_data.get("trace_file")
        if upload is not None and upload.size > whatif.MAX_UPLOAD_BYTES:
            raise forms.ValidationError(
                f"{upload.name} is {upload.size / 1024 / 1024:.1f} MB; the limit is "
                f"{whatif.MAX_UPLOAD_BYTES // 1024 // 1024} MB."
            )
        return upload
