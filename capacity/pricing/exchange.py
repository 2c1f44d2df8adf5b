"""The exchange rate between GPU types, and the workload mix it is taken at
(docs/design.md#one-currency-per-model-many-gpus).

A replica of a model's reference GPU type mints R MU per minute by definition; a replica of any
other deployment of the model mints R · t_ref(mix) / t_own(mix), t being the replica-seconds
each cost model predicts for the mix. Sellable capacity, the allocation tick and the planner's
pages all take the rate here, at the same mean shape.

The mix is the mean request of a window: its token counts are fractional, and the features are
evaluated there as they are (no rounding: the mean of 3 requests of 100 and 101 tokens is 100.33
tokens, not 100).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

from capacity.pricing.features import Shape, replica_seconds_of, uncached_input_tokens


class PricedCostModel(Protocol):
    pk: int | None
    weights_replica_seconds: Mapping[str, float]
    replica_mu_per_minute: float


@dataclass(frozen=True)
class MeanShape:
    """The mean request of a window; input_tokens is the uncached part, as in Shape."""

    input_tokens: float
    output_tokens: float
    cached_input_tokens: float = 0.0
    images: float = 0.0

    @classmethod
    def of_totals(
        cls,
        *,
        requests: float,
        input_tokens: float,
        output_tokens: float,
        cached_input_tokens: float = 0.0,
    ) -> MeanShape | None:
        """From a window's totals in the API's counts (input includes cached); None when the
        window saw no request."""
        if not requests:
            return None
        return cls(
            input_tokens=uncached_input_tokens(input_tokens, cached_input_tokens) / requests,
            output_tokens=output_tokens / requests,
            cached_input_tokens=cached_input_tokens / requests,
        )

    def replica_seconds(self, weights: Mapping[str, float]) -> float:
        return replica_seconds_of(
            weights,
            input_tokens=self.input_tokens,
            cached_input_tokens=self.cached_input_tokens,
            output_tokens=self.output_tokens,
            images=self.images,
        )

    def rounded(self) -> Shape:
        """Whole tokens, for display."""
        return Shape(
            input_tokens=round(self.input_tokens),
            output_tokens=round(self.output_tokens),
            cached_input_tokens=round(self.cached_input_tokens),
            images=round(self.images),
        )


# The mix when a model served no request in the lookback: a typical chat request.
DEFAULT_MIX = MeanShape(input_tokens=1000.0, output_tokens=250.0)


def replica_mu_per_minute(
    *, reference: PricedCostModel, own: PricedCostModel, mix: MeanShape
) -> float | None:
    """MU/min one replica priced by `own` mints, in the currency of `reference`; None when the
    cost models predict no time for the mix."""
    if own.pk == reference.pk:
        return reference.replica_mu_per_minute
    t_reference = mix.replica_seconds(reference.weights_replica_seconds)
    t_own = mix.replica_seconds(own.weights_replica_seconds)
    if t_own <= 0 or t_reference <= 0:
        return None
    return reference.replica_mu_per_minute * t_reference / t_own
