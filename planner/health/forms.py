"""The degradation policy form: the thresholds' rules are checked here, on their fields,
before the database's check constraint could refuse them."""

from typing import Any, cast

from django import forms

from capacity.health.services import MAX_SECONDS, policy_problems
from capacity.models import ServedModel


class PolicyForm(forms.Form):
    """A model's degradation policy: its thresholds, timings, and levels 2 and 3."""

    enabled = forms.BooleanField(required=False, initial=True)
    degrade_below = forms.FloatField(
        label="Degrade below (healthy share)",
        initial=0.75,
        widget=forms.NumberInput(attrs={"step": "0.01"}),
        help_text="0 < degrade below ≤ recover at ≤ 1",
    )
    recover_at = forms.FloatField(
        label="Recover at (healthy share)",
        initial=0.9,
        widget=forms.NumberInput(attrs={"step": "0.01"}),
    )
    window_seconds = forms.IntegerField(
        label="Window (s)", initial=60, min_value=0, max_value=MAX_SECONDS
    )
    hysteresis_seconds = forms.IntegerField(
        label="Hysteresis (s)", initial=180, min_value=0, max_value=MAX_SECONDS
    )
    max_tokens_cap = forms.IntegerField(
        label="Level 2: max_tokens cap", required=False, min_value=1, max_value=MAX_SECONDS
    )
    fallback_model = forms.ModelChoiceField(
        label="Level 3: fallback model",
        queryset=ServedModel.objects.none(),
        required=False,
        empty_label="— none —",
    )

    def __init__(self, *args: Any, served_model: ServedModel, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.served_model = served_model
        fallback_model = cast("forms.ModelChoiceField[ServedModel]", self.fields["fallback_model"])
        fallback_model.queryset = ServedModel.objects.exclude(pk=served_model.pk).order_by("name")

    def clean(self) -> dict[str, Any]:
        """The thresholds' rules (capacity.health.services.policy_problems), each on its field."""
        super().clean()
        cleaned = self.cleaned_data
        values = {
            name: cleaned.get(name)
            for name in ("degrade_below", "recover_at", "window_seconds", "hysteresis_seconds")
        }
        if any(values[name] is None for name in values):
            return cleaned  # a field error is shown already
        values["max_tokens_cap"] = cleaned.get("max_tokens_cap")
        values["fallback_model"] = cleaned.get("fallback_model")
        for field, reasons in policy_problems(self.served_model, values).items():
            for reason in reasons:
                self.add_error(field, reason)
        return cleaned
