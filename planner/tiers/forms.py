"""Forms of the tiers page; they validate shape only, accounts.services decides the rest."""

from django import forms

from accounts.services import MAX_SHED_ORDER, MAX_TIER_WEIGHT


class TierChangeForm(forms.Form):
    """A tier's label, weight and shed order (its name is fixed once created)."""

    label = forms.CharField(max_length=100, required=False)
    weight = forms.FloatField(
        min_value=0.0,
        max_value=MAX_TIER_WEIGHT,
        help_text="Share of the even part of best-effort slack, relative to the other tiers.",
    )
    shed_order = forms.IntegerField(
        min_value=1,
        max_value=MAX_SHED_ORDER,
        label="Shed order",
        help_text="Degradation refuses the best-effort traffic of the lowest first.",
    )


class TierForm(TierChangeForm):
    """A new tier: its name as well."""

    name = forms.SlugField(
        max_length=20, help_text="What customers refer to the tier by: fixed once created."
    )
    field_order = ["name", "label", "weight", "shed_order"]
