"""What a benchmark reports: a figure beside a baseline measured in the same run."""

from dataclasses import dataclass


@dataclass(frozen=True)
class Figure:
    name: str  # e.g. "me_latency"
    value: float
    unit: str  # e.g. "ms/request"; the baseline is in the same unit
    baseline: float
    baseline_name: str  # what the baseline is, e.g. "GET /healthz"

    @property
    def ratio(self) -> float:
        return self.value / self.baseline if self.baseline else float("nan")

    def as_json(self) -> dict:
        return {
            "value": self.value,
            "unit": self.unit,
            "baseline": self.baseline,
            "baseline_name": self.baseline_name,
            "ratio": self.ratio,
        }
