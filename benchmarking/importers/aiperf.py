"""AIPerf's `profile_export_aiperf.json` (ai-dynamo/aiperf, aiperf/exporters/json_exporter.py
and aiperf/common/models/export_models.py).

AIPerf writes genai-perf's layout on purpose (its export model says so): the same metric
objects in display units (ms, tokens, requests/sec), read by `genai_perf.read_profile_export`.
What differs is the configuration, AIPerf's `UserConfig` with only what the user set:
`input_config.loadgen.concurrency`, `input_config.endpoint.model_names`; and the run's own
`error_request_count.avg` and `was_cancelled`.
"""

from __future__ import annotations

from typing import Any

from benchmarking.importers._common import MISSING, ImportedSample, fail, lookup
from benchmarking.importers.genai_perf import read_profile_export

FORMAT = "aiperf"
TITLE = "an AIPerf export (profile_export_aiperf.json)"


def looks_like(document: Any) -> bool:
    if not isinstance(document, dict) or not isinstance(document.get("request_throughput"), dict):
        return False
    config = document.get("input_config")
    return (
        lookup(config, "loadgen") is not MISSING
        or lookup(config, "endpoint.model_names") is not MISSING
        or "was_cancelled" in document
        or "error_summary" in document
    )


def _or_none(value: Any) -> Any:
    return None if value is MISSING else value


def read(where: str, document: Any, *, hint: str = "") -> ImportedSample:
    if isinstance(document, dict) and document.get("was_cancelled") is True:
        raise fail(
            f"{where}: the AIPerf run was cancelled before it finished; its figures are not a "
            "whole run.",
            code="cancelled_run",
        )
    config = document.get("input_config") if isinstance(document, dict) else None
    return read_profile_export(
        where,
        document,
        what=TITLE,
        concurrency=_or_none(lookup(config, "loadgen.concurrency")),
        model=_or_none(lookup(config, "endpoint.model_names")),
        errors=_or_none(lookup(document, "error_request_count.avg")),
        hint=hint,
    )
