"""Pricing request shapes with a stored cost model: replica-seconds, MU and requests/s.

The currency lives in one place, `capacity.pricing.features`, which is pure numpy and shared
by the fit and by pricing so that the two can never disagree.
"""

from collections.abc import Iterable, Mapping

from capacity.models import CostModel
from capacity.pricing.features import Shape, mu_of, predict_replica_seconds


def shape_from(row: Mapping) -> Shape:
    """API shapes count all prompt tokens in input_tokens; the fit's feature is the uncached
    part."""
    return Shape.from_api(
        input_tokens=int(row["input_tokens"]),
        cached_input_tokens=int(row.get("cached_input_tokens", 0) or 0),
        output_tokens=int(row["output_tokens"]),
        images=int(row.get("images", 0) or 0),
    )


def shape_mu(cost_model: CostModel, row: Mapping) -> float:
    replica_seconds = predict_replica_seconds(cost_model.weights_replica_seconds, shape_from(row))
    return mu_of(replica_seconds, cost_model.replica_mu_per_minute)


def price_shapes(cost_model: CostModel, rows: Iterable[Mapping]) -> list[dict]:
    priced = []
    for row in rows:
        replica_seconds = predict_replica_seconds(
            cost_model.weights_replica_seconds, shape_from(row)
        )
        priced.append(
            {
                "input_tokens": int(row["input_tokens"]),
                "cached_input_tokens": int(row.get("cached_input_tokens", 0) or 0),
                "output_tokens": int(row["output_tokens"]),
                "images": int(row.get("images", 0) or 0),
                "replica_seconds": replica_seconds,
                "mu": mu_of(replica_seconds, cost_model.replica_mu_per_minute),
                "requests_per_s": 1.0 / replica_seconds if replica_seconds > 0 else None,
            }
        )
    return priced
