"""Write the demo's two weeks of demand as rate windows (simulation/data/scenarios/README.md).

    python scripts/demo_week_trace.py

seed_demo replays the last seven days of them through the fleet simulator as the demo's history
(`simulation/demo_history.py`). Two files, one per customer, because their request sizes come
from different Azure traces: `demo_week_acme.csv` (conversation sizes) and `demo_week_globex.csv`
(code sizes). 10-minute windows from a Monday 00:00 UTC, 14 days, so that any seven days ending
now fall inside (seed_demo aligns the file's Mondays with the calendar's).

Each customer's rate follows a day/night curve on weekdays,
`mean × scale × (night + (1 − night) × ((1 + cos(2π(h − peak_hour)/24)) / 2)^1.5)` with `scale`
chosen so that a weekday averages `weekday_mean`, and `weekend_share` of it on Saturdays and
Sundays. The means are the rates `make run`'s traffic generator sends (scripts/run.sh), so the
history and the live traffic meet at the same level on average.
"""

import csv
import math
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "simulation" / "data" / "scenarios"
WINDOW_SECONDS = 600
DAYS = 14

CUSTOMERS = {
    # weekday mean req/s, peak hour (UTC), night share, weekend share, inter-arrival cv
    "acme": {"weekday_mean": 5.0, "peak_hour": 15, "night": 0.25, "weekend": 0.5, "cv": 1.0},
    "globex": {"weekday_mean": 7.0, "peak_hour": 13, "night": 0.15, "weekend": 0.3, "cv": 2.0},
}


def _shape(hour: float, peak_hour: float, night: float) -> float:
    day = ((1 + math.cos(2 * math.pi * (hour - peak_hour) / 24)) / 2) ** 1.5
    return night + (1 - night) * day


def main() -> None:
    for name, c in CUSTOMERS.items():
        windows_per_day = 86400 // WINDOW_SECONDS
        hours = [(i + 0.5) * WINDOW_SECONDS / 3600 for i in range(windows_per_day)]
        mean_shape = sum(_shape(h, c["peak_hour"], c["night"]) for h in hours) / len(hours)
        path = OUT / f"demo_week_{name}.csv"
        with open(path, "w", newline="") as handle:
            writer = csv.writer(handle)
            writer.writerow(["window_start_s", "rate_req_per_s", "cv", "client"])
            for day in range(DAYS):
                weekend = day % 7 >= 5  # day 0 is a Monday
                for index, hour in enumerate(hours):
                    rate = c["weekday_mean"] * _shape(hour, c["peak_hour"], c["night"])
                    rate /= mean_shape
                    if weekend:
                        rate *= c["weekend"]
                    start = (day * windows_per_day + index) * WINDOW_SECONDS
                    writer.writerow([start, f"{rate:.3f}", c["cv"], name])
        print(f"{path.relative_to(ROOT)}: {DAYS * windows_per_day} windows")


if __name__ == "__main__":
    main()
