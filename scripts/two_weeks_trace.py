"""Write the two-week scenario's rate windows (simulation/data/scenarios/README.md).

    python scripts/two_weeks_trace.py

The demo's weekly shape (`demo_week_acme.csv`, `demo_week_globex.csv`: the first seven days of
each, from a Monday 00:00 UTC) repeated for WEEKS weeks, each 10-minute window's rate times its
own multiplicative noise (lognormal, σ = NOISE_SIGMA, mean 1, seeded), so no two weeks (nor two
days) are the same and a forecaster meets the noise a real history has. Both customers' rates are
scaled by RATE_SCALE: the simulator's cost is per request (about 11 µs of CPU a request and
policy, beside each live policy's ticks and forecast fits), and the benchmark's budget is tight;
at 0.3 the busiest windows need two replicas (at 0.2 one static replica keeps the SLO, and
there is nothing to save). Written to
`simulation/data/scenarios/demo_two_weeks.csv`; request sizes come from the Azure conversation
trace for both customers (`--sizes`), so the cv and the shape are the demo's, the sizes not
globex's. Deterministic: the same file on every run.
"""

import csv
import math
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
SCENARIOS = ROOT / "simulation" / "data" / "scenarios"
OUT = SCENARIOS / "demo_two_weeks.csv"
SHAPES = ("demo_week_acme.csv", "demo_week_globex.csv")
WINDOW_SECONDS = 600
WEEK_WINDOWS = 7 * 86400 // WINDOW_SECONDS
WEEKS = 2
NOISE_SIGMA = 0.1
RATE_SCALE = 0.3
SEED = 36


def _week(path: Path) -> tuple[str, list[tuple[float, str]]]:
    """(client, the first week's (rate req/s, cv) per window) of a demo file."""
    with open(path, newline="") as handle:
        rows = list(csv.DictReader(handle))[:WEEK_WINDOWS]
    if len(rows) < WEEK_WINDOWS:
        raise SystemExit(f"{path}: fewer than a week of {WINDOW_SECONDS} s windows")
    for index, row in enumerate(rows):
        if int(float(row["window_start_s"])) != index * WINDOW_SECONDS:
            raise SystemExit(f"{path}: window {index} does not start at {index * WINDOW_SECONDS}")
    return rows[0]["client"], [(float(row["rate_req_per_s"]), row["cv"]) for row in rows]


def main() -> None:
    rng = np.random.default_rng(SEED)
    rows: list[tuple[int, str, str, str]] = []
    for name in SHAPES:
        client, week = _week(SCENARIOS / name)
        # Mean 1: exp(σz − σ²/2) keeps each window's expected rate the demo's.
        noise = np.exp(NOISE_SIGMA * rng.standard_normal(WEEKS * WEEK_WINDOWS) - NOISE_SIGMA**2 / 2)
        for index in range(WEEKS * WEEK_WINDOWS):
            rate, cv = week[index % WEEK_WINDOWS]
            noisy = rate * RATE_SCALE * float(noise[index])
            rows.append((index * WINDOW_SECONDS, f"{noisy:.4f}", cv, client))
    rows.sort(key=lambda row: (row[0], row[3]))
    with open(OUT, "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["window_start_s", "rate_req_per_s", "cv", "client"])
        writer.writerows(rows)
    days = WEEKS * WEEK_WINDOWS * WINDOW_SECONDS / 86400
    total = sum(float(row[1]) for row in rows) * WINDOW_SECONDS
    print(
        f"{OUT.relative_to(ROOT)}: {days:.0f} days, {len(rows)} windows, "
        f"about {math.floor(total / 1e3):.0f} k requests"
    )


if __name__ == "__main__":
    main()
