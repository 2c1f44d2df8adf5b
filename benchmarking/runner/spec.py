"""What the runner is asked to measure: a suite's shapes and its SLO, and the error that
ends a run."""

from collections.abc import Sequence
from dataclasses import dataclass


class RunnerError(Exception):
    """The run cannot go on (unreachable endpoint, too many errors): a clear reason."""


@dataclass(frozen=True)
class GridShape:
    """One shape of a suite: `input_len` text tokens (images' tokens come on top, as the
    engine counts them), `output_len` tokens decoded, the share of the prompt every request of
    the shape shares (a prefix the engine's prefix cache can serve), and images per request.
    The rest of every prompt, and every image, is distinct per request."""

    input_len: int
    output_len: int
    prefix_share: float = 0.0
    images: int = 0

    @classmethod
    def of(cls, shape: "GridShape | Sequence[int]") -> "GridShape":
        if isinstance(shape, GridShape):
            return shape
        input_len, output_len = shape
        return cls(int(input_len), int(output_len))

    @property
    def shared_tokens(self) -> int:
        return round(self.prefix_share * self.input_len)

    def describe(self) -> str:
        text = f"{self.input_len}/{self.output_len}"
        if self.prefix_share:
            text += f" ({self.prefix_share:.0%} shared)"
        if self.images:
            text += f" + {self.images} image{'s' if self.images > 1 else ''}"
        return text


@dataclass(frozen=True)
class SuiteSpec:
    grid: tuple["GridShape | tuple[int, int]", ...]
    slo_ttft_p95_ms: float
    slo_tpot_p95_ms: float
    duration_per_point_seconds: float = 20.0
    concurrency_start: int = 1
    max_concurrency: int = 256
    min_throughput_growth: float = 0.05
    max_error_rate: float = 0.05
    request_timeout_seconds: float = 120.0

    @property
    def shapes(self) -> tuple[GridShape, ...]:
        return tuple(GridShape.of(shape) for shape in self.grid)
