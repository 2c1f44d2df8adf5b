"""Find the benchmarks, run them on a throwaway database, write var/bench/*.json, print a table.

A benchmark is a module bench/bench_NAME.py with `run() -> list[Figure]`. It runs after Django is
set up, against a fresh test database (test_<NAME of DATABASE_URL>) that is dropped at the end,
so a run never reads or writes real data; its tables are flushed before each benchmark.
"""

import importlib
import json
import os
import pkgutil
import sys
import time
import traceback
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT_DIR = ROOT / "var" / "bench"
PREFIX = "bench_"


def discover(selected: list[str]) -> list[str]:
    """Names (module name without the prefix) of the benchmarks to run, sorted."""
    import bench

    names = sorted(
        info.name.removeprefix(PREFIX)
        for info in pkgutil.iter_modules(bench.__path__)
        if info.name.startswith(PREFIX)
    )
    if selected:
        names = [name for name in names if any(word in name for word in selected)]
    return names


def _setup_django() -> None:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")
    # WhiteNoise warns once per process that collectstatic has not run; benchmarks serve no files.
    warnings.filterwarnings("ignore", "No directory at", UserWarning)
    import django

    django.setup()


def _format_number(value: float) -> str:
    return f"{value:.4g}"


def format_table(rows: list[tuple[str, object]]) -> str:
    header = ("benchmark", "figure", "value", "unit", "baseline (what)", "ratio", "target")
    lines = [header]
    for benchmark, figure in rows:
        lines.append(
            (
                benchmark,
                figure.name,
                _format_number(figure.value),
                figure.unit,
                f"{_format_number(figure.baseline)} ({figure.baseline_name})",
                f"{figure.ratio:.2f}x",
                figure.target,
            )
        )
    widths = [max(len(line[column]) for line in lines) for column in range(len(header))]
    numeric = {2, 5}

    def render(line) -> str:
        cells = [
            cell.rjust(width) if column in numeric and line is not header else cell.ljust(width)
            for column, (cell, width) in enumerate(zip(line, widths, strict=True))
        ]
        return " | ".join(cells).rstrip()

    rule = "-+-".join("-" * width for width in widths)
    return "\n".join([render(header), rule, *(render(line) for line in lines[1:])])


def _write(name: str, figures: list, seconds: float) -> Path:
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    path = OUT_DIR / f"{name}.json"
    body = {
        "benchmark": name,
        "seconds": round(seconds, 3),
        "figures": {figure.name: figure.as_json() for figure in figures},
    }
    path.write_text(json.dumps(body, indent=2) + "\n")
    return path


def main(argv: list[str]) -> int:
    _setup_django()
    from django.core.management import call_command
    from django.test.utils import (
        setup_databases,
        setup_test_environment,
        teardown_databases,
        teardown_test_environment,
    )

    names = discover(argv)
    if not names:
        print(f"No benchmark matches {' '.join(argv)!r}.", file=sys.stderr)
        return 2

    rows = []
    failed = []
    setup_test_environment()
    old_config = setup_databases(verbosity=0, interactive=False)
    try:
        for name in names:
            print(f"== {name}", flush=True)
            # Each benchmark starts from empty tables: one's fixture is never another's data.
            call_command("flush", interactive=False, verbosity=0)
            started = time.perf_counter()
            try:
                module = importlib.import_module(f"bench.{PREFIX}{name}")
                figures = module.run()
            except Exception:
                traceback.print_exc()
                failed.append(name)
                continue
            seconds = time.perf_counter() - started
            path = _write(name, figures, seconds)
            print(f"   {len(figures)} figures in {seconds:.1f} s -> {path.relative_to(ROOT)}")
            rows.extend((name, figure) for figure in figures)
    finally:
        teardown_databases(old_config, verbosity=0)
        teardown_test_environment()

    print()
    if rows:
        print(format_table(rows))
    if failed:
        print(f"\nFailed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0
