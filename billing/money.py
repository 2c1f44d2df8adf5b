"""The one rounding rule: a line's amount, to cents, half up, once, when the line is made."""

from decimal import ROUND_HALF_UP, Decimal

CENT = Decimal("0.01")


def money(amount: Decimal) -> Decimal:
    """The amount to cents, half up."""
    return amount.quantize(CENT, rounding=ROUND_HALF_UP)
