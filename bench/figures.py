"""What a benchmark reports: a figure beside a baseline measured in the same run."""

from dataclasses import dataclass


@dataclass(frozen=True)
class Figure:
    name: str  # e.g. "me_latency"
    value: float
    unit: str  # e.g. "ms/request"; the baseline is in the same unit
    baseline: float
    baseline_name: str  # what the baseline is, e.g. "GET /healthz"
    # The ratio an issue asks for, if any: at least it (higher is better) or at most it.
    target_ratio: float | None = None
    higher_is_better: bool = True

    @property
    def ratio(self) -> float:
        return self.value / self.baseline if self.baseline else float("nan")

    @property
    def target(self) -> str:
        """ "≥ 0.80x met", "≤ 15x missed", or "" without a target."""
        if self.target_ratio is None:
            return ""
        met = (
            self.ratio >= self.target_ratio
            if self.higher_is_better
            else self.ratio <= self.target_ratio
        )
        sign = "≥" if self.higher_is_better else "≤"
        return f"{sign} {self.target_ratio:.2f}x {'met' if met else 'missed'}"

    def as_json(self) -> dict:
        return {
            "target": self.target,
            "value": self.value,
            "unit": self.unit,
            "baseline": self.baseline,
            "baseline_name": self.baseline_name,
            "ratio": self.ratio,
        }
