"""The tools' own result files: vLLM's `bench serve` JSON, genai-perf's and AIPerf's profile
exports and trtllm-bench's report, imported from the command line and fitted.

The sample files (tests/benchmarking/data/README.md) carry the figures of tables the project
ships, so an import must fit to exactly the cost model of the table it came from.
"""

import csv
import io
import json
import math
from pathlib import Path

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError
from hypothesis import given, settings
from hypothesis import strategies as st

from benchmarking.fitting import fit_cost_model
from benchmarking.importers import detect_format, parse_result_files
from benchmarking.models import BenchmarkRun, BenchmarkSample
from capacity.models import CostModel, GpuType, ServedModel
from capacity.pricing.features import Shape
from core.errors import DomainError

ROOT = Path(__file__).resolve().parents[2]
SAMPLES = Path(__file__).resolve().parent / "data"
TABLES = ROOT / "benchmarking" / "data"

VLLM = [SAMPLES / "vllm_bench_serve_llama31-8b_l40s_tp1.jsonl"]
GENAI_PERF = sorted(SAMPLES.glob("genai-perf/*/profile_export_genai_perf.json"))
AIPERF = sorted(SAMPLES.glob("aiperf/*/profile_export_aiperf.json"))
TRTLLM_BENCH = sorted(SAMPLES.glob("trtllm-bench/report_*.json"))

# format: (its sample files, how many records they hold, the table their figures come from)
CASES = {
    "vllm": (VLLM, 8, TABLES / "emulator" / "llama31-8b_l40s_tp1.csv"),
    "genai-perf": (GENAI_PERF, 8, TABLES / "emulator" / "qwen25-72b_h100_tp4.csv"),
    "aiperf": (AIPERF, 8, TABLES / "emulator" / "qwen25-72b_a100_tp4.csv"),
    "trtllm-bench": (TRTLLM_BENCH, 10, TABLES / "trtllm_llama33-70b_fp8_h100_tp2.csv"),
}


def run_command(*args) -> str:
    out = io.StringIO()
    call_command(*args, stdout=out)
    return out.getvalue()


def import_json(*args) -> dict:
    return json.loads(run_command("import_benchmark", *map(str, args), "--json"))


def table_fit(path: Path):
    with path.open(newline="") as handle:
        rows = list(csv.DictReader(handle))
    shapes = [Shape(int(row["input_len"]), int(row["output_len"])) for row in rows]
    return fit_cost_model(shapes, [float(row["requests_per_s"]) for row in rows])


def write(tmp_path: Path, name: str, document) -> Path:
    path = tmp_path / name
    path.write_text(document if isinstance(document, str) else json.dumps(document))
    return path


def escaped(text: str) -> str:
    return text.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")


def assert_nothing_written() -> None:
    assert not BenchmarkRun.objects.exists()
    assert not BenchmarkSample.objects.exists()
    assert not ServedModel.objects.filter(name="new-model").exists()
    assert not GpuType.objects.filter(name="NEW-GPU").exists()


def vllm_record(**changes) -> dict:
    record = json.loads(VLLM[0].read_text().splitlines()[0])
    record.update(changes)
    return record


# --- each tool's files load and fit ------------------------------------------------------------


def test_every_sample_set_is_there():
    assert len(GENAI_PERF) == len(AIPERF) == 8
    assert len(TRTLLM_BENCH) == 10


@pytest.mark.parametrize("file_format", CASES)
@pytest.mark.parametrize("told", [False, True], ids=["detected", "told"])
@pytest.mark.django_db
@pytest.mark.both_databases
def test_a_tools_result_files_are_imported_and_fit_as_their_table_does(file_format, told):
    files, records, table = CASES[file_format]
    args = ["--format", file_format] if told else []

    report = import_json(*files, "--model", "m", "--gpu", "G", "--fit", *args)

    run = BenchmarkRun.objects.get(pk=report["run"])
    assert run.source == BenchmarkRun.Source.IMPORT
    assert run.status == BenchmarkRun.Status.SUCCEEDED
    assert report["rows"] == run.samples.count() == records
    assert run.samples.filter(sustainable=True).count() == records  # one run per shape
    assert file_format in run.progress_message
    model = report["cost_model"]
    assert model["sample_count"] == records
    weights = model["weights_replica_seconds"]
    assert all(math.isfinite(w) and w >= 0 for w in weights.values())
    assert any(weights[name] > 0 for name in model["features"])
    assert all(r["predicted_replica_seconds"] > 0 for r in model["residuals"])
    # Same shapes, same throughputs: the very cost model of the table the figures came from.
    expected = table_fit(table)
    assert model["features"] == list(expected.features)
    for name, weight in expected.weights_replica_seconds.items():
        assert weights[name] == pytest.approx(weight, rel=1e-6, abs=1e-15)
    assert model["cv_mape"] == pytest.approx(expected.cv_mape, rel=1e-6)


@pytest.mark.django_db
@pytest.mark.both_databases
def test_the_files_own_details_land_on_the_samples():
    import_json(*VLLM, "--model", "llama-3.1-8b", "--gpu", "L40S-48GB")
    sample = BenchmarkSample.objects.get(input_len=128, output_len=32)
    assert sample.requests_per_s == pytest.approx(117.7335)
    assert sample.concurrency == 256
    assert sample.ttft_p95_ms == pytest.approx(1610.3)
    assert sample.tpot_p95_ms == pytest.approx(52.54)
    assert sample.request_count == 589
    assert sample.output_tokens_per_s == pytest.approx(117.7335 * 32)
    run = sample.run
    assert run.engine_model_id == "llama-3.1-8b"
    assert run.source_detail == VLLM[0].name
    # A new served model takes the id the tool measured, which the gateway must send.
    assert ServedModel.objects.get(name="llama-3.1-8b").engine_model_id == "llama-3.1-8b"


@pytest.mark.django_db
@pytest.mark.both_databases
def test_a_trtllm_bench_report_says_how_many_gpus_a_replica_ran_on():
    report = import_json(*TRTLLM_BENCH, "--model", "llama-3.3-70b", "--gpu", "H100-80GB")
    assert report["gpus_per_replica"] == 2
    run = BenchmarkRun.objects.get(pk=report["run"])
    assert run.gpus_per_replica == 2
    assert run.engine_model_id == "nvidia/Llama-3.3-70B-Instruct-FP8"
    assert run.samples.get(input_len=128, output_len=128).request_count == 30000
    with pytest.raises(CommandError, match="ran on 2 GPUs, not 4"):
        import_json(*TRTLLM_BENCH, "--model", "x", "--gpu", "G", "--gpus-per-replica", "4")


@pytest.mark.django_db
@pytest.mark.both_databases
def test_genai_perf_runs_named_alike_are_told_apart_by_their_directories():
    out = run_command("import_benchmark", *map(str, GENAI_PERF[:2]), "--model", "q", "--gpu", "G")
    run = BenchmarkRun.objects.get()
    first, second = (f"{p.parent.name}/{p.name}" for p in GENAI_PERF[:2])
    assert run.source_detail == f"{first}, {second}"
    assert f"Imported 2 shapes from {first}, {second} as run {run.pk}." in out
    sample = run.samples.get(input_len=1024, output_len=128)
    assert sample.concurrency == 32
    assert sample.ttft_p95_ms == pytest.approx(1470.5)


@pytest.mark.django_db
@pytest.mark.both_databases
def test_replicas_behind_the_endpoint_divide_its_throughput():
    import_json(*VLLM, "--model", "m", "--gpu", "G", "--replicas", "2")
    run = BenchmarkRun.objects.get()
    assert run.replicas == 2
    assert run.samples.get(input_len=128, output_len=32).requests_per_s == pytest.approx(
        117.7335 / 2
    )


@pytest.mark.django_db
@pytest.mark.both_databases
def test_a_concurrency_sweep_keeps_every_point_and_fits_the_highest_per_shape(tmp_path):
    lines = [json.dumps(json.loads(line)) for line in VLLM[0].read_text().splitlines()]
    slower = vllm_record(max_concurrency=64, request_throughput=80.0)
    path = write(tmp_path, "sweep.jsonl", "\n".join([json.dumps(slower), *lines]) + "\n")

    report = import_json(path, "--model", "m", "--gpu", "G", "--fit")

    assert report["rows"] == 9
    assert report["shapes"] == 8
    points = BenchmarkSample.objects.filter(input_len=128, output_len=32)
    assert sorted(points.values_list("concurrency", "sustainable")) == [(64, False), (256, True)]
    assert report["cost_model"]["sample_count"] == 8


@pytest.mark.django_db
@pytest.mark.both_databases
def test_a_csv_table_still_imports_as_before():
    out = run_command(
        "import_benchmark", str(TABLES / "trtllm_llama31-8b_fp8_h100_tp1.csv"), "--model", "m",
        "--gpu", "H100",
    )  # fmt: skip
    assert "Imported 10 shapes from trtllm_llama31-8b_fp8_h100_tp1.csv as run" in out
    assert BenchmarkRun.objects.get().progress_message == "imported 10 rows"


# --- a file of the wrong kind ------------------------------------------------------------------


@pytest.mark.django_db
@pytest.mark.both_databases
@pytest.mark.parametrize(
    ("files", "args", "says"),
    [
        (
            GENAI_PERF[:1],
            ["--format", "vllm"],
            "is not a `vllm bench serve --save-result` result: it lacks completed, "
            "total_input_tokens, total_output_tokens",
        ),
        (GENAI_PERF[:1], ["--format", "vllm"], "import it with the format genai-perf"),
        (VLLM, ["--format", "trtllm-bench"], "it lacks performance.request_throughput_req_s"),
        (
            TRTLLM_BENCH[:1],
            ["--format", "aiperf"],
            "it lacks request_throughput.avg, input_sequence_length.avg, "
            "output_sequence_length.avg",
        ),
        (VLLM, ["--format", "csv"], "is JSON, not a throughput table"),
        ([TABLES / "trtllm_llama31-8b_fp8_h100_tp1.csv"], ["--format", "vllm"], "is not JSON"),
        ([*VLLM, *TRTLLM_BENCH[:1]], [], "The files are of different formats"),
        ([TABLES / "trtllm_llama31-8b_fp8_h100_tp1.csv"] * 2, [], "import one CSV file"),
    ],
)
def test_a_file_of_the_wrong_kind_is_refused_naming_what_it_lacks(files, args, says):
    with pytest.raises(CommandError, match=escaped(says)):
        run_command(
            "import_benchmark", *map(str, files), *args, "--model", "new-model", "--gpu", "NEW-GPU"
        )
    assert_nothing_written()


@pytest.mark.django_db
@pytest.mark.both_databases
@pytest.mark.parametrize(
    ("name", "content", "says"),
    [
        ("empty.json", "", "lacks the column(s)"),
        ("broken.json", '{"completed": 3,', "is not valid JSON"),
        ("other.json", {"hello": 1}, "Cannot tell which tool wrote"),
        ("other.json", {"hello": 1}, "other.json has hello"),
        ("list.json", [1, 2], "has a JSON int, not an object"),
        (
            "profile_export.jsonl",
            '{"metadata": {"session_num": 0}, "metrics": {}, "error": null}\n',
            "per-request profile_export.jsonl; import the run's summary",
        ),
        ("profile_export.json", {"experiments": [], "version": "x"}, "raw profile_export.json"),
        (
            "throughput.json",
            {"elapsed_time": 9.5, "num_requests": 100, "requests_per_second": 10.5},
            "does not say the requests' lengths",
        ),
        (
            "embeddings.json",
            {"completed": 10, "total_input_tokens": 100, "request_throughput": 3.0},
            "it lacks total_output_tokens",
        ),
        ("zero.json", vllm_record(request_throughput=0), "request_throughput must be a positive"),
        ("nan.json", vllm_record(request_throughput=float("nan")), "must be a positive number"),
        ("none.json", vllm_record(completed=0), "completed must be a whole number from 1"),
        ("huge.json", vllm_record(total_input_tokens=10**18), "must be a mean token count"),
        ("half.json", vllm_record(completed=2.5), "completed must be a whole number"),
        ("bool.json", vllm_record(completed=True), "completed must be a whole number"),
        ("failed.json", vllm_record(completed=100, failed=10), "10 of 110 requests failed"),
        ("short.json", vllm_record(total_output_tokens=0), "must be a mean token count"),
        (
            "cancelled.json",
            {**json.loads(AIPERF[0].read_text()), "was_cancelled": True},
            "the AIPerf run was cancelled",
        ),
        (
            "seconds.json",
            {
                **json.loads(GENAI_PERF[0].read_text()),
                "time_to_first_token": {"unit": "s", "p95": 1.2},
            },
            "time_to_first_token is in 's'",
        ),
        (
            "errors.json",
            {
                **json.loads(AIPERF[0].read_text()),
                "error_request_count": {"unit": "requests", "avg": 5},
            },
            "5 of 20 requests failed",
        ),
        ("array.json", [json.loads(TRTLLM_BENCH[0].read_text())] * 2, "is one object per file"),
    ],
)
def test_a_bad_file_is_refused_with_the_reason_and_nothing_is_written(
    tmp_path, name, content, says
):
    path = write(tmp_path, name, content)
    with pytest.raises(CommandError, match=escaped(says)):
        run_command("import_benchmark", str(path), "--model", "new-model", "--gpu", "NEW-GPU")
    assert_nothing_written()


@pytest.mark.django_db
@pytest.mark.both_databases
def test_files_that_measured_different_models_are_not_mixed(tmp_path):
    other = write(tmp_path, "other.json", vllm_record(model_id="another-model"))
    with pytest.raises(CommandError, match="disagree on the model they measured"):
        run_command("import_benchmark", str(VLLM[0]), str(other), "--model", "m", "--gpu", "G")
    assert not BenchmarkRun.objects.exists()


@pytest.mark.django_db
@pytest.mark.both_databases
def test_replicas_do_not_apply_to_a_per_replica_csv():
    table = TABLES / "trtllm_llama31-8b_fp8_h100_tp1.csv"
    with pytest.raises(CommandError, match="per replica already"):
        run_command("import_benchmark", str(table), "--model", "m", "--gpu", "G", "--replicas", "2")


@pytest.mark.django_db
@pytest.mark.both_databases
def test_a_file_that_fits_no_model_is_imported_but_says_why_it_cannot_be_fitted():
    with pytest.raises(CommandError, match="Imported as run .*at least 6 distinct"):
        run_command("import_benchmark", *map(str, TRTLLM_BENCH[:3]), "--model", "m", "--gpu", "G",
                    "--fit")  # fmt: skip
    assert not CostModel.objects.exists()


# --- never anything but the domain's error -----------------------------------------------------

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda children: (
        st.lists(children, max_size=4)
        | st.dictionaries(
            st.sampled_from(
                [
                    "request_throughput",
                    "completed",
                    "total_input_tokens",
                    "total_output_tokens",
                    "failed",
                    "avg",
                    "input_sequence_length",
                    "output_sequence_length",
                    "input_config",
                    "loadgen",
                    "concurrency",
                    "performance",
                    "request_info",
                    "request_throughput_req_s",
                    "avg_input_length",
                    "avg_output_length",
                    "world_info",
                    "tp_size",
                    "world_size",
                    "unit",
                    "p95",
                    "time_to_first_token",
                    "was_cancelled",
                    "endpoint",
                    "model_names",
                    "model_id",
                ]
            ),  # fmt: skip
            children,
            max_size=6,
        )
    ),
    max_leaves=20,
)


@settings(max_examples=300, deadline=None)
@given(document=json_values, file_format=st.sampled_from(["auto", "vllm", "genai-perf",
                                                          "aiperf", "trtllm-bench"]))  # fmt: skip
def test_any_json_is_either_read_or_refused_with_the_domain_error(document, file_format):
    text = json.dumps(document)
    try:
        results = parse_result_files([("any.json", text)], file_format=file_format)
    except DomainError as error:
        assert error.field is not None
        assert error.message
        return
    assert all(sample.requests_per_s > 0 and sample.input_len >= 1 for sample in results.samples)


def test_each_sample_set_is_told_by_its_content():
    for file_format, (files, _, _) in CASES.items():
        assert {detect_format(path.name, path.read_text()) for path in files} == {file_format}
