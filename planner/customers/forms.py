"""Forms of the customer pages; they validate shape only, the services decide the rest."""

from collections.abc import Iterable
from typing import Any, cast

from django import forms

from accounts import scopes as S
from accounts.models import DEFAULT_TIER, ApiKey, Tier
from capacity.models import ServedModel


class CustomerForm(forms.Form):
    """A new customer: its name, slug and tier, and whether it may report its own usage."""

    name = forms.CharField(max_length=200)
    slug = forms.SlugField(max_length=64, help_text="Lower-case letters, digits and hyphens.")
    tier = forms.ModelChoiceField(
        queryset=Tier.objects.order_by("shed_order"),
        to_field_name="name",
        initial=DEFAULT_TIER,
        empty_label=None,
    )
    may_report_own_usage = forms.BooleanField(
        required=False,
        label="May report its own usage",
        help_text="Its keys may post usage events (marked self-reported on its invoices).",
    )


class DateTimeInput(forms.DateTimeInput):
    """The browser's date-and-time picker, in the format it sends back."""

    input_type = "datetime-local"

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(format="%Y-%m-%dT%H:%M", **kwargs)


class ReservationForm(forms.Form):
    """A new reservation: MU per minute of one model, from a start (else now) to an end (else
    open-ended)."""

    served_model = forms.ModelChoiceField(
        queryset=ServedModel.objects.order_by("name"), label="Model", empty_label=None
    )
    mu_per_minute = forms.FloatField(label="MU per minute", min_value=0.000001)
    starts_at = forms.DateTimeField(
        label="Starts (UTC)", required=False, widget=DateTimeInput, help_text="Empty: now."
    )
    ends_at = forms.DateTimeField(
        label="Ends (UTC)", required=False, widget=DateTimeInput, help_text="Empty: open-ended."
    )
    keep_warm = forms.BooleanField(required=False, label="Keep warm")
    notes = forms.CharField(required=False, max_length=500)


class AmendForm(forms.Form):
    """A reservation's new rate and end."""

    mu_per_minute = forms.FloatField(label="MU per minute", min_value=0.000001)
    ends_at = forms.DateTimeField(
        label="Ends (UTC)", required=False, widget=DateTimeInput, help_text="Empty: open-ended."
    )


class ApiKeyForm(forms.Form):
    """A new API key of a customer: its name, scopes and expiry."""

    name = forms.CharField(max_length=200)
    scopes = forms.MultipleChoiceField(
        choices=[(scope, scope) for scope in S.CUSTOMER_SCOPES],
        initial=S.DEFAULT_CUSTOMER_SCOPES,
        widget=forms.CheckboxSelectMultiple,
    )
    expires_at = forms.DateTimeField(
        label="Expires (UTC)", required=False, widget=DateTimeInput, help_text="Empty: never."
    )


class RequestLimitForm(forms.Form):
    """A customer's (or one of its keys') RPM, TPM and concurrency limits; empty: no limit."""

    api_key = forms.ChoiceField(
        label="For", required=False, help_text="All its keys, or one of them."
    )
    requests_per_minute = forms.IntegerField(
        label="Requests per minute", required=False, min_value=1,
        help_text="In any sliding 60 s window.",
    )  # fmt: skip
    tokens_per_minute = forms.IntegerField(
        label="Tokens per minute", required=False, min_value=1,
        help_text="input_tokens + max_tokens, in any sliding 60 s window.",
    )  # fmt: skip
    concurrent_requests = forms.IntegerField(
        label="Requests in flight", required=False, min_value=1
    )

    def __init__(self, *args: Any, keys: Iterable[ApiKey] = (), **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        cast(forms.ChoiceField, self.fields["api_key"]).choices = [("", "All its keys")] + [
            (key.prefix, f"{key.prefix} ({key.name})") for key in keys
        ]


class MembershipRemoveForm(forms.Form):
    """Removing a person from a customer: whether the keys they made go with them (offered
    checked, as a key a person made would otherwise outlive their place in the customer)."""

    revoke_keys = forms.BooleanField(
        required=False, initial=True, label="Also revoke the keys this person made"
    )
