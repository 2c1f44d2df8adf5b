"""Import a published throughput table and fit it from the command line alone."""

import io
import json
from pathlib import Path

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError

from benchmarking.models import BenchmarkRun, BenchmarkSample
from capacity.models import CostModel, GpuType, ServedModel

pytestmark = pytest.mark.django_db

DATA = Path(__file__).resolve().parents[2] / "benchmarking" / "data"
LLAMA_8B_TABLE = DATA / "trtllm_llama31-8b_fp8_h100_tp1.csv"


def run_command(*args) -> str:
    out = io.StringIO()
    call_command(*args, stdout=out)
    return out.getvalue()


def test_a_published_table_is_imported_and_fitted_from_the_command_line():
    out = run_command(
        "import_benchmark", str(LLAMA_8B_TABLE), "--model", "llama-3.1-8b", "--gpu", "H100-80GB"
    )
    assert "Created GPU type 'H100-80GB'" in out
    assert "Created served model 'llama-3.1-8b'" in out
    run = BenchmarkRun.objects.get()
    assert run.source == BenchmarkRun.Source.IMPORT
    assert run.status == BenchmarkRun.Status.SUCCEEDED
    assert run.samples.filter(sustainable=True).count() == 10

    report = json.loads(
        run_command("fit_cost_model", "--model", "llama-3.1-8b", "--gpu", "H100-80GB", "--json")
    )
    assert report["version"] == 1
    assert report["status"] == "active"  # CV MAPE is under 10 %
    assert report["cv_mape"] < 0.10
    assert set(report["features"]) >= {"input_tokens", "output_tokens", "request"}
    # α = w_input · R / 60 with R = 100 MU per replica-minute.
    weights = report["weights_replica_seconds"]
    assert report["alpha_mu_per_input_token"] == pytest.approx(weights["input_tokens"] * 100 / 60)
    assert report["gamma_mu_per_request"] == pytest.approx(weights["request"] * 100 / 60)
    assert len(report["residuals"]) == 10
    assert len(report["candidates"]) >= 4


def test_a_better_second_fit_retires_the_first_and_versions_count_up():
    run_command("import_benchmark", str(LLAMA_8B_TABLE), "--model", "m", "--gpu", "H100", "--fit")
    run_command("import_benchmark", str(LLAMA_8B_TABLE), "--model", "m", "--gpu", "H100")
    run_command("fit_cost_model", "--model", "m", "--gpu", "H100")
    versions = dict(CostModel.objects.values_list("version", "status"))
    assert versions == {1: "retired", 2: "active"}


def test_predict_cost_prints_a_csv_from_the_active_model(tmp_path):
    run_command("import_benchmark", str(LLAMA_8B_TABLE), "--model", "m", "--gpu", "H100", "--fit")
    shapes = tmp_path / "shapes.csv"
    shapes.write_text("input_len,output_len\n1000,1000\n128,128\n")
    out = run_command("predict_cost", "--model", "m", "--gpu", "H100", str(shapes))
    lines = out.strip().splitlines()
    assert lines[0] == "input_len,output_len,replica_seconds,mu,requests_per_s"
    row = dict(zip(lines[0].split(","), lines[1].split(","), strict=True))
    # The table measured 15.22 requests/s at 1000/1000; the fit lands near it.
    assert float(row["requests_per_s"]) == pytest.approx(15.22, rel=0.10)
    assert float(row["mu"]) == pytest.approx(float(row["replica_seconds"]) * 100 / 60, rel=1e-4)


@pytest.mark.parametrize(
    ("content", "says"),
    [
        ("input_len,output_len\n1,2\n", "lacks the column(s) requests_per_s"),
        ("input_len,output_len,requests_per_s\n128,128,0\n", "line 2: requests_per_s must be > 0"),
        ("input_len,output_len,requests_per_s\n128,-5,3\n", "line 2: output_len must be > 0"),
        ("input_len,output_len,requests_per_s\n128,128,fast\n", "'fast' is not a number"),
        ("input_len,output_len,requests_per_s\n128,128,2\n128,128,3\n", "repeats line 2"),
        ("input_len,output_len,requests_per_s\n", "no rows"),
        ("input_len,output_len,requests_per_s\n12.5,128,2\n", "not a whole number"),
        ("input_len,output_len,requests_per_s\n128,128,nan\n", "requests_per_s must be > 0"),
    ],
)
def test_a_bad_csv_is_refused_with_the_reason_and_nothing_is_written(tmp_path, content, says):
    path = tmp_path / "bad.csv"
    # A good first row, so a half-written import would show.
    path.write_text(content)
    with pytest.raises(CommandError, match=says.replace("(", r"\(").replace(")", r"\)")):
        run_command("import_benchmark", str(path), "--model", "new-model", "--gpu", "NEW-GPU")
    assert not BenchmarkRun.objects.exists()
    assert not BenchmarkSample.objects.exists()
    assert not ServedModel.objects.filter(name="new-model").exists()
    assert not GpuType.objects.filter(name="NEW-GPU").exists()


def test_a_bad_row_after_good_rows_writes_nothing(tmp_path):
    path = tmp_path / "late.csv"
    path.write_text("input_len,output_len,requests_per_s\n128,128,2\n256,128,1.5\n512,64,-1\n")
    with pytest.raises(CommandError, match="line 4"):
        run_command("import_benchmark", str(path), "--model", "x", "--gpu", "G")
    assert not BenchmarkRun.objects.exists()


def test_a_grid_that_does_not_vary_output_length_cannot_be_fitted(tmp_path):
    path = tmp_path / "flat.csv"
    rows = "".join(f"{n},128,{100 / n}\n" for n in (64, 128, 256, 512, 1024, 2048))
    path.write_text("input_len,output_len,requests_per_s\n" + rows)
    with pytest.raises(CommandError, match="output length"):
        run_command("import_benchmark", str(path), "--model", "x", "--gpu", "G", "--fit")
    assert not CostModel.objects.exists()


def test_too_few_shapes_cannot_be_fitted(tmp_path):
    path = tmp_path / "few.csv"
    path.write_text("input_len,output_len,requests_per_s\n128,128,9\n256,64,8\n512,256,3\n")
    run_command("import_benchmark", str(path), "--model", "x", "--gpu", "G")
    with pytest.raises(CommandError, match="at least 6 distinct"):
        run_command("fit_cost_model", "--model", "x", "--gpu", "G")
    assert not CostModel.objects.exists()


def test_a_poor_fit_stays_a_candidate(tmp_path, settings):
    settings.COST_MODEL_MAX_ACTIVE_MAPE = 0.001
    run_command("import_benchmark", str(LLAMA_8B_TABLE), "--model", "m", "--gpu", "H100", "--fit")
    assert CostModel.objects.get().status == CostModel.Status.CANDIDATE


def test_fit_cost_model_refuses_unknown_names():
    with pytest.raises(CommandError, match="No served model named 'ghost'"):
        run_command("fit_cost_model", "--model", "ghost", "--gpu", "H100")
