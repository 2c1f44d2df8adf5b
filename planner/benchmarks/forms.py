"""The forms of a cost model's page: "Run now" (it validates shape only, run_queue decides
the rest) and the reason of a decision on a version."""

from django import forms

from benchmarking.selectors import suites
from capacity.models import Deployment


class RunNowForm(forms.Form):
    deployment = forms.ModelChoiceField(
        queryset=Deployment.objects.none(), empty_label="Choose a deployment"
    )
    suite = forms.ModelChoiceField(
        queryset=suites(),
        required=False,
        empty_label="The deployment's suite",
    )
    replicas = forms.IntegerField(
        min_value=1,
        max_value=1000,
        initial=1,
        help_text="Replicas behind the endpoint: measured throughput is divided by this.",
    )

    def __init__(self, *args, deployments, **kwargs):
        super().__init__(*args, **kwargs)
        self.fields["deployment"].queryset = deployments
        self.fields["deployment"].label_from_instance = self._deployment_label

    @staticmethod
    def _deployment_label(deployment):
        suite = deployment.benchmark_suite.name if deployment.benchmark_suite else "no suite"
        endpoint = deployment.endpoint_url or "no endpoint"
        return f"{deployment.name} ({suite}; {endpoint})"

    def clean(self):
        cleaned = super().clean()
        deployment = cleaned.get("deployment")
        if deployment is not None and cleaned.get("suite") is None:
            if deployment.benchmark_suite is None:
                raise forms.ValidationError(
                    f"Deployment {deployment.name} has no benchmark suite: choose a suite."
                )
            cleaned["suite"] = deployment.benchmark_suite
        return cleaned


class DecisionForm(forms.Form):
    """Why a planner activates or rejects a version: kept on it and in the audit log."""

    reason = forms.CharField(
        required=False,
        max_length=2000,
        widget=forms.TextInput(attrs={"size": 40, "placeholder": "Why (kept in the audit log)"}),
    )
