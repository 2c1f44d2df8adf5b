"""The forms of a cost model's page: "Run now" (it validates shape only, run_queue decides
the rest) and the reason of a decision on a version."""

from typing import Any, cast

from django import forms
from django.db.models import QuerySet

from benchmarking.selectors import suite_of, suites
from capacity.models import Deployment


class RunNowForm(forms.Form):
    """A benchmark run of one of the group's deployments, with a suite (else its own)."""

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

    def __init__(self, *args: Any, deployments: QuerySet[Deployment], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        deployment = cast("forms.ModelChoiceField[Deployment]", self.fields["deployment"])
        deployment.queryset = deployments
        # One field's own labels: Django's way is to replace the method on the instance.
        deployment.label_from_instance = self._deployment_label  # type: ignore[method-assign, assignment]

    @staticmethod
    def _deployment_label(deployment: Deployment) -> str:
        suite = suite_of(deployment)
        suite_name = suite.name if suite is not None else "no suite"
        endpoint = deployment.endpoint_url or "no endpoint"
        return f"{deployment.name} ({suite_name}; {endpoint})"

    def clean(self) -> dict[str, Any]:
        """Without a suite, the deployment's own; refused when it has none."""
        super().clean()
        cleaned = self.cleaned_data
        deployment = cleaned.get("deployment")
        if deployment is not None and cleaned.get("suite") is None:
            suite = suite_of(deployment)
            if suite is None:
                raise forms.ValidationError(
                    f"Deployment {deployment.name} has no benchmark suite: choose a suite."
                )
            cleaned["suite"] = suite
        return cleaned


class DecisionForm(forms.Form):
    """Why a planner activates or rejects a version: kept on it and in the audit log."""

    reason = forms.CharField(
        required=False,
        max_length=2000,
        widget=forms.TextInput(attrs={"size": 40, "placeholder": "Why (kept in the audit log)"}),
    )
