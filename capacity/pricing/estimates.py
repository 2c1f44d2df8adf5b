"""Pricing request shapes with a stored cost model: replica-seconds, MU and requests/s.

The feature definitions live in one place, `benchmarking.fitting`, which is pure numpy and
shared by the fit and by pricing so that the two can never disagree.
"""

from collections.abc import Iterable, Mapping

from benchmarking.fitting import Shape, predict_replica_seconds
from capacity.models import CostModel


def shape_from(row: Mapping) -> Shape:
    """API shapes count all prompt tokens in input_tokens; the fit's feature is the uncached
    part."""
    cached = int(row.get("cached_input_tokens", 0) or 0)
    return Shape(
        input_tokens=int(row["input_tokens"]) - cached,
        output_tokens=int(row["output_tokens"]),
        cached_input_tokens=cached,
        images=int(row.get("images", 0) or 0),
    )


def mu_of(cost_model: CostModel, row: Mapping) -> float:
    replica_seconds = predict_replica_seconds(cost_model.weights_replica_seconds, shape_from(row))
    return replica_seconds * cost_model.replica_mu_per_minute / 60.0


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
                "mu": replica_seconds * cost_model.replica_mu_per_minute / 60.0,
                "requests_per_s": 1.0 / replica_seconds if replica_seconds > 0 else None,
            }
        )
    return priced
