"""Fleet simulator: each policy's GPU-hours and SLO attainment beside static-peak's, same run.

Traces: Azure's code and conversation traces scaled to about ten replicas at peak (static-peak
sizes 9 and 10), and the two-day, three-customer diurnal rate-window scenario
(simulation/data/scenarios). Also prints each comparison as the `simulate` command does, and
the share of the oracle's savings over static-peak that modelunit captures.
"""

from pathlib import Path

from bench.figures import Figure
from simulation.engine.compare import compare
from simulation.engine.traces import load_trace
from simulation.management.commands.simulate import BUILT_IN_MODEL, load_scenario

DATA = Path(__file__).resolve().parent.parent / "simulation" / "data"
TRACES = DATA / "traces"
POLICIES = ["static-peak", "kpa", "hpa-rps", "oracle", "modelunit"]
CASES = (
    # name, trace, sizes, scale, scenario, warm-up
    ("azure_code_x2.6", TRACES / "AzureLLMInferenceTrace_code_2023.csv", None, 2.6, None, True),
    ("azure_conv_x5.8", TRACES / "AzureLLMInferenceTrace_conv_2023.csv", None, 5.8, None, True),
    (
        "diurnal_2d",
        DATA / "scenarios" / "diurnal_2d.csv",
        TRACES / "AzureLLMInferenceTrace_conv_2023.csv",
        1.0,
        DATA / "scenarios" / "diurnal_2d.json",
        False,  # two days: the first night warms the policies up
    ),
)


def _share(policies: dict) -> float:
    static = policies["static-peak"]["gpu_hours"]
    oracle_savings = static - policies["oracle"]["gpu_hours"]
    if oracle_savings <= 0:
        return float("nan")
    return (static - policies["modelunit"]["gpu_hours"]) / oracle_savings


def run() -> list[Figure]:
    figures = []
    for name, trace, sizes, scale, scenario_path, warm_up in CASES:
        scenario = load_scenario(str(scenario_path) if scenario_path else None)
        requests = load_trace(trace, sizes_path=sizes, scale=scale, seed=0)
        report = compare(
            requests,
            model=BUILT_IN_MODEL,
            policies=POLICIES,
            slo_ttft_ms=2000,
            cold_start_seconds=scenario["cold_start_seconds"],
            target_utilisation=scenario["target_utilisation"],
            reservations=scenario["reservations"],
            keep_warm=scenario["keep_warm"],
            warm_up=warm_up,
        )["policies"]
        print(f"\n{name}: {len(requests)} requests")
        print(f"{'policy':<12} {'gpu_hours':>9} {'savings':>8} {'slo':>8} {'ttft p99 ms':>11}")
        for policy, row in report.items():
            print(
                f"{policy:<12} {row['gpu_hours']:>9.2f} {row['savings_vs_static']:>8.1%} "
                f"{row['slo_attainment']:>8.2%} {row['ttft_p99_ms']:>11.0f}"
            )
        print(f"modelunit captures {_share(report):.0%} of the oracle's savings over static-peak")
        static = report["static-peak"]
        for policy, row in report.items():
            if policy == "static-peak":
                continue
            figures.append(
                Figure(
                    f"{name}_{policy}_gpu_hours",
                    row["gpu_hours"],
                    "GPU-h",
                    static["gpu_hours"],
                    "static-peak",
                )
            )
            figures.append(
                Figure(
                    f"{name}_{policy}_slo_attainment",
                    row["slo_attainment"],
                    "share",
                    static["slo_attainment"],
                    "static-peak",
                )
            )
    return figures
