"""Fleet simulator: each policy's GPU-hours, SLO attainment and refusals beside static-peak's,
same run.

Every policy runs behind the live admission (the one bucket rule, the live policy's allowances
from the policy's ready replicas; `simulation.engine.compare`), so a policy that sizes its fleet
short refuses requests rather than queueing them: the table gives, per policy, the share of
guaranteed traffic (customers with a reservation) and of best-effort traffic refused, beside
GPU-hours and the SLO attainment of every request (refused ones miss).

Traces: Azure's code and conversation traces scaled to about ten replicas at peak (static-peak
sizes 9 and 10), one client without a reservation; the conversation trace again dealt half to
acme, which reserves about its mean (250 MU/min), and half to globex, best-effort (issue 19's
acceptance scenario); and the two-day, three-customer diurnal rate-window scenario
(simulation/data/scenarios). Also prints each comparison as the `simulate` command does, and
the share of the oracle's savings over static-peak that modelunit captures.
"""

import math
from dataclasses import dataclass, field
from pathlib import Path

from bench.figures import Figure
from simulation.engine.compare import compare
from simulation.engine.traces import load_trace, split_clients
from simulation.management.commands.simulate import BUILT_IN_MODEL, load_scenario

DATA = Path(__file__).resolve().parent.parent / "simulation" / "data"
TRACES = DATA / "traces"
CONVERSATION = TRACES / "AzureLLMInferenceTrace_conv_2023.csv"
POLICIES = ["static-peak", "kpa", "hpa-rps", "oracle", "modelunit"]
# Each is printed, and a figure beside static-peak's (NaN ones, a share of no traffic, are not).
FIGURES = {
    "gpu_hours": "GPU-h",
    "slo_attainment": "share",
    "refused_guaranteed_share": "share",
    "refused_best_effort_share": "share",
}


@dataclass(frozen=True)
class Case:
    name: str
    trace: Path
    scale: float = 1.0
    sizes: Path | None = None
    scenario: Path | None = None
    warm_up: bool = True
    split: dict[str, float] = field(default_factory=dict)  # one client dealt out to several
    reservations: dict[str, float] = field(default_factory=dict)  # beside the scenario's


CASES = (
    Case("azure_code_x2.6", TRACES / "AzureLLMInferenceTrace_code_2023.csv", 2.6),
    Case("azure_conv_x5.8", CONVERSATION, 5.8),
    Case(
        "azure_conv_x5.8_reserved",
        CONVERSATION,
        5.8,
        split={"acme": 0.5, "globex": 0.5},
        reservations={"acme": 250.0},
    ),
    Case(
        "diurnal_2d",
        DATA / "scenarios" / "diurnal_2d.csv",
        sizes=CONVERSATION,
        scenario=DATA / "scenarios" / "diurnal_2d.json",
        warm_up=False,  # two days: the first night warms the policies up
    ),
)


def _share(policies: dict) -> float:
    static = policies["static-peak"]["gpu_hours"]
    oracle_savings = static - policies["oracle"]["gpu_hours"]
    if oracle_savings <= 0:
        return float("nan")
    return (static - policies["modelunit"]["gpu_hours"]) / oracle_savings


def _percent(value: float) -> str:
    return "-" if math.isnan(value) else f"{value:.2%}"


def run() -> list[Figure]:
    print(
        "refused G / BE: the share of guaranteed (reserved customers') and of best-effort "
        "requests refused; G in res.: of the reserved customers' requests within their "
        "reservation; G slo: SLO attainment of the requests admitted as guaranteed ('-': no "
        "such traffic)"
    )
    figures = []
    for case in CASES:
        scenario = load_scenario(str(case.scenario) if case.scenario else None)
        requests = load_trace(case.trace, sizes_path=case.sizes, scale=case.scale, seed=0)
        if case.split:
            requests = split_clients(requests, case.split, seed=0)
        report = compare(
            requests,
            model=BUILT_IN_MODEL,
            policies=POLICIES,
            slo_ttft_ms=2000,
            cold_start_seconds=scenario["cold_start_seconds"],
            target_utilisation=scenario["target_utilisation"],
            reservations=scenario["reservations"] | case.reservations,
            keep_warm=scenario["keep_warm"],
            warm_up=case.warm_up,
        )["policies"]
        print(f"\n{case.name}: {len(requests)} requests")
        print(
            f"{'policy':<12} {'gpu_hours':>9} {'savings':>8} {'slo':>8} {'ttft p99 ms':>11} "
            f"{'refused G':>9} {'refused BE':>10} {'G in res.':>9} {'G slo':>8}"
        )
        for policy, row in report.items():
            print(
                f"{policy:<12} {row['gpu_hours']:>9.2f} {row['savings_vs_static']:>8.1%} "
                f"{row['slo_attainment']:>8.2%} {row['ttft_p99_ms']:>11.0f} "
                f"{_percent(row['refused_guaranteed_share']):>9} "
                f"{_percent(row['refused_best_effort_share']):>10} "
                f"{_percent(row['refused_within_reservation_share']):>9} "
                f"{_percent(row['guaranteed_slo_attainment']):>8}"
            )
        print(f"modelunit captures {_share(report):.0%} of the oracle's savings over static-peak")
        static = report["static-peak"]
        for policy, row in report.items():
            if policy == "static-peak":
                continue
            for key, unit in FIGURES.items():
                if math.isnan(row[key]) or math.isnan(static[key]):
                    continue
                name = f"{case.name}_{policy}_{key}"
                figures.append(Figure(name, row[key], unit, static[key], "static-peak"))
    return figures
