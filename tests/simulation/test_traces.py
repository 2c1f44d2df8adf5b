"""Demand traces: the shipped Azure traces, rate windows, scaling, summaries and bad input.

Pure functions on files; no database.
"""

from pathlib import Path

import numpy as np
import pytest

from simulation.engine.traces import (
    TraceError,
    TraceRequest,
    load_rate_windows,
    load_request_trace,
    load_trace,
    summarise,
)

TRACES = Path(__file__).resolve().parents[2] / "simulation" / "data" / "traces"
CODE = TRACES / "AzureLLMInferenceTrace_code_2023.csv"
CONV = TRACES / "AzureLLMInferenceTrace_conv_2023.csv"


def write(tmp_path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def arrivals(requests) -> np.ndarray:
    return np.array([r.arrival_s for r in requests])


def counts_per_bin(requests, bin_s: float, duration_s: float) -> np.ndarray:
    return np.bincount(
        (arrivals(requests) // bin_s).astype(int), minlength=int(np.ceil(duration_s / bin_s))
    )


@pytest.fixture(scope="module")
def code():
    return load_trace(CODE)


@pytest.fixture(scope="module")
def conv():
    return load_trace(CONV)


@pytest.fixture
def sizes(tmp_path):
    return write(
        tmp_path,
        "sizes.csv",
        "input_tokens,output_tokens\n100,10\n200,20\n300,30\n400,40\n",
    )


def windows_file(tmp_path, rows: list[str], header="window_start_s,rate_req_per_s,cv") -> Path:
    return write(tmp_path, "windows.csv", header + "\n" + "\n".join(rows) + "\n")


# --- the shipped Azure traces ------------------------------------------------------------------


def test_the_azure_code_trace_loads_with_the_counts_and_sizes_its_readme_states(code):
    summary = summarise(code)
    assert summary.requests == 8_819
    assert summary.mean_input_tokens == pytest.approx(2_048, abs=1)
    assert summary.mean_output_tokens == pytest.approx(28, abs=0.5)
    assert summary.duration_s == pytest.approx(57 * 60, abs=60)
    assert summary.mean_rate_req_per_s == pytest.approx(2.6, abs=0.05)
    assert summary.clients == ("default",)
    assert code[0] == TraceRequest(arrival_s=0.0, input_tokens=4808, output_tokens=10)
    assert code[1].arrival_s == pytest.approx(0.052)
    assert np.all(np.diff(arrivals(code)) >= 0)
    assert np.diff(arrivals(code)).max() == pytest.approx(217, abs=1)  # the longest idle gap


def test_the_azure_conversation_trace_loads_with_the_counts_and_sizes_its_readme_states(conv):
    summary = summarise(conv)
    assert summary.requests == 19_366
    assert summary.mean_input_tokens == pytest.approx(1_155, abs=1)
    assert summary.mean_output_tokens == pytest.approx(211, abs=0.5)
    assert summary.duration_s == pytest.approx(58 * 60, abs=60)
    assert summary.mean_rate_req_per_s == pytest.approx(5.5, abs=0.05)
    assert summary.mean_rate_req_per_s < summary.peak_rate_req_per_s_1min < 20


# --- scaling a per-request trace ---------------------------------------------------------------


@pytest.mark.parametrize("path", [CODE, CONV], ids=["code", "conv"])
def test_scale_2_doubles_the_requests_and_keeps_the_shape_over_time(path):
    original = load_request_trace(path)
    doubled = load_request_trace(path, scale=2, seed=3)
    duration = original[-1].arrival_s

    assert len(doubled) == 2 * len(original)
    assert np.all(np.diff(arrivals(doubled)) >= 0)
    assert doubled[0].arrival_s == 0.0 and doubled[-1].arrival_s == duration
    before = counts_per_bin(original, 600, duration)
    after = counts_per_bin(doubled, 600, duration)
    assert np.corrcoef(before, after)[0, 1] > 0.95
    assert after.sum() / before.sum() == 2
    # Every request appears exactly twice, with its sizes.
    sizes_before = sorted((r.input_tokens, r.output_tokens) for r in original)
    sizes_after = sorted((r.input_tokens, r.output_tokens) for r in doubled)
    assert sizes_after == sorted(sizes_before * 2)


def test_copies_stay_near_the_original_and_do_not_fill_idle_gaps(code):
    doubled = load_request_trace(CODE, scale=2, seed=0)
    gaps = np.diff(arrivals(code))
    longest = int(np.argmax(gaps))
    idle_start, idle_end = code[longest].arrival_s, code[longest + 1].arrival_s
    typical_gap = code[-1].arrival_s / (len(code) - 1)
    inside = [r for r in doubled if idle_start + typical_gap < r.arrival_s < idle_end]
    assert inside == []


def test_scale_half_keeps_a_seeded_half_at_the_original_times(conv):
    halved = load_request_trace(CONV, scale=0.5, seed=1)
    duration = conv[-1].arrival_s

    assert len(halved) == round(len(conv) / 2)
    assert set(halved) <= set(conv)
    before = counts_per_bin(conv, 600, duration)
    after = counts_per_bin(halved, 600, duration)
    assert np.corrcoef(before, after)[0, 1] > 0.95
    assert summarise(halved).mean_output_tokens == pytest.approx(211, rel=0.05)


def test_a_fractional_scale_above_one_rounds_the_count(code):
    scaled = load_request_trace(CODE, scale=2.5, seed=0)
    assert len(scaled) == round(2.5 * len(code))
    assert summarise(scaled).mean_input_tokens == pytest.approx(2_048, rel=0.03)


def test_scaling_is_deterministic_under_the_seed():
    assert load_request_trace(CODE, scale=1.7, seed=5) == load_request_trace(
        CODE, scale=1.7, seed=5
    )
    assert load_request_trace(CODE, scale=1.7, seed=5) != load_request_trace(
        CODE, scale=1.7, seed=6
    )


# --- per-request traces in the plain format ----------------------------------------------------


def test_a_plain_trace_keeps_seconds_as_given_and_reads_clients(tmp_path):
    path = write(
        tmp_path,
        "plain.csv",
        "timestamp,input_tokens,output_tokens,client\n"
        "10.5,100,5,acme\n"
        "10.5,200,6,globex\n"
        "\n"
        "12,300,7,acme\n",
    )
    assert load_trace(path) == [
        TraceRequest(10.5, 100, 5, "acme"),
        TraceRequest(10.5, 200, 6, "globex"),
        TraceRequest(12.0, 300, 7, "acme"),
    ]
    assert summarise(load_trace(path)).clients == ("acme", "globex")


def test_a_plain_trace_with_iso_datetimes_starts_at_zero(tmp_path):
    path = write(
        tmp_path,
        "iso.csv",
        "timestamp,input_tokens,output_tokens\n"
        "2024-03-01T23:59:59.5+00:00,1,1\n"
        "2024-03-02T01:00:00.5+01:00,2,2\n"
        "2024-03-02T00:00:02Z,3,3\n",
    )
    assert arrivals(load_trace(path)).tolist() == [0.0, 1.0, 2.5]


# --- rate windows ------------------------------------------------------------------------------


def test_rate_windows_with_cv_1_give_poisson_counts(tmp_path, sizes):
    # Two hours at 10 req/s in one-minute windows; counts per second.
    path = windows_file(tmp_path, [f"{60 * m},10,1" for m in range(120)])
    requests = load_rate_windows(path, sizes_path=sizes, seed=0)
    per_second = counts_per_bin(requests, 1, 7_200)

    assert len(per_second) == 7_200
    assert per_second.mean() == pytest.approx(10, rel=0.03)
    assert per_second.var() / per_second.mean() == pytest.approx(1, abs=0.1)
    assert requests[0].arrival_s >= 0 and requests[-1].arrival_s < 7_200


def test_rate_windows_with_cv_3_are_burstier(tmp_path, sizes):
    path = windows_file(tmp_path, ["0,10,3", "3600,10,3", "7200,10,3"])
    requests = load_rate_windows(path, sizes_path=sizes, seed=0)
    per_second = counts_per_bin(requests, 1, 10_800)

    assert per_second.mean() == pytest.approx(10, rel=0.05)
    assert per_second.var() / per_second.mean() > 4  # 9 (cv²) for long bins; Poisson is 1
    gaps = np.diff(arrivals(requests))
    assert gaps.std() / gaps.mean() == pytest.approx(3, rel=0.1)


def test_cv_0_spaces_arrivals_evenly(tmp_path, sizes):
    path = windows_file(tmp_path, ["0,4,0", "10,2,0", "20,0,0"])
    requests = load_rate_windows(path, sizes_path=sizes)
    gaps = np.diff(arrivals(requests))
    assert len(requests) == 60  # 40 + 20; the last window (rate 0) lasts 10 s too
    assert np.allclose(gaps[:39], 0.25) and np.allclose(gaps[-19:], 0.5)


def test_rates_follow_the_windows_and_the_last_window_repeats_the_previous_length(tmp_path, sizes):
    rows = ["0,2", "600,20", "1200,0", "1500,5"]
    path = windows_file(tmp_path, rows, "window_start_s,rate_req_per_s")
    requests = load_rate_windows(path, sizes_path=sizes, seed=2)
    counts = np.histogram(arrivals(requests), bins=[0, 600, 1200, 1500, 1800, 1e9])[0]

    assert counts[0] == pytest.approx(1_200, rel=0.1)
    assert counts[1] == pytest.approx(12_000, rel=0.05)
    assert counts[2] == 0
    assert counts[3] == pytest.approx(1_500, rel=0.1)  # 300 s, like the window before it
    assert counts[4] == 0


def test_an_explicit_window_end_leaves_a_gap_and_ends_the_last_window(tmp_path, sizes):
    path = windows_file(
        tmp_path,
        ["0,10,1,100", "200,10,,250"],
        "window_start_s,rate_req_per_s,cv,window_end_s",
    )
    times = arrivals(load_rate_windows(path, sizes_path=sizes))
    assert np.all((times < 100) | ((times >= 200) & (times < 250)))
    assert np.sum(times < 100) == pytest.approx(1_000, rel=0.15)
    assert np.sum(times >= 200) == pytest.approx(500, rel=0.2)


def test_sizes_come_from_the_sizes_trace_as_pairs(tmp_path, sizes):
    path = windows_file(tmp_path, ["0,50", "100,50"], "window_start_s,rate_req_per_s")
    requests = load_rate_windows(path, sizes_path=sizes)
    pairs = {(r.input_tokens, r.output_tokens) for r in requests}
    assert pairs == {(100, 10), (200, 20), (300, 30), (400, 40)}


def test_rate_windows_draw_sizes_from_a_real_trace(tmp_path):
    path = windows_file(tmp_path, ["0,20", "600,20"], "window_start_s,rate_req_per_s")
    summary = summarise(load_trace(path, sizes_path=CONV, seed=4))
    assert summary.mean_input_tokens == pytest.approx(1_155, rel=0.05)
    assert summary.mean_output_tokens == pytest.approx(211, rel=0.05)


def test_scale_multiplies_the_rate_of_rate_windows(tmp_path, sizes):
    path = windows_file(tmp_path, ["0,10", "600,10"], "window_start_s,rate_req_per_s")
    base = load_rate_windows(path, sizes_path=sizes, seed=1)
    scaled = load_rate_windows(path, sizes_path=sizes, seed=1, scale=3)
    assert len(base) == pytest.approx(12_000, rel=0.05)
    assert len(scaled) == pytest.approx(36_000, rel=0.05)


def test_multi_client_windows_keep_clients_apart(tmp_path, sizes):
    header = "client,window_start_s,rate_req_per_s,cv"
    rows = ["acme,0,10,1", "globex,0,1,3", "acme,600,0,1", "globex,300,2,1", "acme,1200,5,1"]
    requests = load_rate_windows(windows_file(tmp_path, rows, header), sizes_path=sizes)
    acme = arrivals([r for r in requests if r.client == "acme"])
    globex = arrivals([r for r in requests if r.client == "globex"])

    assert summarise(requests).clients == ("acme", "globex")
    assert np.all(np.diff(arrivals(requests)) >= 0)
    assert len(acme) + len(globex) == len(requests)
    # acme: 10/s for 600 s, nothing, then 5/s for 600 s; globex: 1/s for 300 s, 2/s for 300 s.
    assert np.sum(acme < 600) == pytest.approx(6_000, rel=0.05)
    assert not np.any((acme >= 600) & (acme < 1200))
    assert np.sum(acme >= 1200) == pytest.approx(3_000, rel=0.06)
    assert acme.max() < 1800
    assert np.sum(globex < 300) == pytest.approx(300, rel=0.5)
    assert np.sum(globex >= 300) == pytest.approx(600, rel=0.2)
    assert globex.max() < 600

    # Each client draws from its own stream: dropping globex leaves acme's arrivals unchanged.
    acme_only = [row for row in rows if row.startswith("acme")]
    alone = load_rate_windows(windows_file(tmp_path, acme_only, header), sizes_path=sizes)
    assert [r for r in requests if r.client == "acme"] == alone


def test_rate_windows_are_deterministic_under_the_seed(tmp_path, sizes):
    path = windows_file(tmp_path, ["0,5,2", "60,7,0.5"])
    first = load_trace(path, sizes_path=sizes, seed=9, scale=1.5)
    assert first == load_trace(path, sizes_path=sizes, seed=9, scale=1.5)
    assert first != load_trace(path, sizes_path=sizes, seed=10, scale=1.5)


# --- summaries ---------------------------------------------------------------------------------


def test_summarise_counts_the_busiest_minute():
    requests = [TraceRequest(float(t), 10, 2) for t in range(0, 300, 10)]  # 0.1/s for 290 s
    requests += [TraceRequest(100 + i / 10, 30, 4, "b") for i in range(60)]  # 60 in 6 s
    summary = summarise(requests)
    assert summary.requests == 90
    assert summary.duration_s == 290
    assert summary.mean_rate_req_per_s == pytest.approx(90 / 290)
    assert summary.peak_rate_req_per_s_1min == pytest.approx((60 + 6) / 60)
    assert summary.mean_input_tokens == pytest.approx((30 * 10 + 60 * 30) / 90)
    assert summary.mean_output_tokens == pytest.approx((30 * 2 + 60 * 4) / 90)
    assert summary.clients == ("b", "default")
    assert summarise([]).requests == 0


# --- bad input ---------------------------------------------------------------------------------

REQUEST_HEADER = "timestamp,input_tokens,output_tokens\n"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            REQUEST_HEADER + "12,1,1\n13.0,1,1\n12.5,1,1\n",
            "bad.csv line 4: timestamps go backwards (12.5 after 13.0)",
        ),
        (REQUEST_HEADER + "1,5,1\n2,-3,1\n", "bad.csv line 3: input_tokens -3 is negative"),
        (REQUEST_HEADER + "1,5,2.5\n", "bad.csv line 2: output_tokens 2.5 is not a whole number"),
        (REQUEST_HEADER + "1,five,1\n", "bad.csv line 2: input_tokens 'five' is not a number"),
        (
            REQUEST_HEADER + "1,5,1\nsoon,5,1\n",
            "bad.csv line 3: timestamp 'soon' is neither seconds nor an ISO datetime",
        ),
        (REQUEST_HEADER + "1,5,1\n2,nan,1\n", "bad.csv line 3: input_tokens 'nan' is not a finite"),
        (REQUEST_HEADER + "1,5\n", "bad.csv line 2: expected 3 values, got 2"),
        ("", "bad.csv line 1: empty file"),
        ("\n\n", "bad.csv line 1: empty file"),
        (REQUEST_HEADER, "bad.csv line 1: the header has no rows"),
        (
            "timestamp,input_tokens,output_tokens,priority\n1,1,1,high\n",
            "bad.csv line 1: unknown column 'priority'; accepted columns: timestamp",
        ),
        (
            "timestamp,input_tokens\n1,1\n",
            "bad.csv line 1: missing column(s) output_tokens; accepted columns:",
        ),
        (
            "TIMESTAMP,ContextTokens,GeneratedTokens\n"
            "2023-11-16 18:15:46.6805900,374,44\n2023-11-16 18:15:45.0,1,1\n",
            "bad.csv line 3: timestamps go backwards (2023-11-16 18:15:45.0 after 2023-11-16",
        ),
        (
            REQUEST_HEADER + "1,1,1\n2024-01-01,1,1\n",
            "bad.csv line 3: timestamp '2024-01-01' mixes",
        ),
    ],
)
def test_a_bad_request_trace_is_refused_naming_the_line(tmp_path, text, message):
    with pytest.raises(TraceError) as caught:
        load_request_trace(write(tmp_path, "bad.csv", text))
    assert str(caught.value).startswith(message)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("window_start_s,rate_req_per_s\n0,1\n60,-2\n", "bad.csv line 3: rate_req_per_s -2 < 0"),
        ("window_start_s,rate_req_per_s,cv\n0,1,-1\n60,1,1\n", "bad.csv line 2: cv -1 < 0"),
        ("window_start_s,rate_req_per_s\n0,fast\n", "bad.csv line 2: rate_req_per_s 'fast' is not"),
        (
            "client,window_start_s,rate_req_per_s\na,0,1\nb,100,1\na,60,1\nb,50,1\n",
            "bad.csv line 5: windows out of order: client 'b' window_start_s 50 is not after 100",
        ),
        ("window_start_s,rate_req_per_s\n0,1\n0,2\n", "bad.csv line 3: windows out of order"),
        ("window_start_s,rate_req_per_s\n", "bad.csv line 1: the header has no rows"),
        (
            "window_start_s,rate_req_per_s,burst\n0,1,2\n",
            "bad.csv line 1: unknown column 'burst'; accepted columns: window_start_s, "
            "rate_req_per_s, optional cv, client, window_end_s",
        ),
        ("window_start_s,cv\n0,1\n", "bad.csv line 1: missing column(s) rate_req_per_s"),
        (
            "window_start_s,rate_req_per_s\n0,1\n",
            "bad.csv line 2: client 'default' has a single window and no window_end_s",
        ),
        (
            "window_start_s,rate_req_per_s,window_end_s\n0,1,90\n60,1,120\n",
            "bad.csv line 2: window_end_s 90 overlaps client 'default''s next window",
        ),
        (
            "window_start_s,rate_req_per_s,window_end_s\n60,1,30\n",
            "bad.csv line 2: window_end_s 30 is not after window_start_s 60",
        ),
        ("window_start_s,rate_req_per_s\n0,1e9\n3600,1e9\n", "bad.csv: the windows would"),
    ],
)
def test_bad_rate_windows_are_refused_naming_the_line(tmp_path, sizes, text, message):
    with pytest.raises(TraceError) as caught:
        load_trace(write(tmp_path, "bad.csv", text), sizes_path=sizes)
    assert str(caught.value).startswith(message)


def test_a_bad_sizes_file_is_named_in_the_error(tmp_path):
    path = windows_file(tmp_path, ["0,1", "60,1"], "window_start_s,rate_req_per_s")
    sizes = write(tmp_path, "sizes.csv", "input_tokens,output_tokens\n1,1\n-1,1\n")
    with pytest.raises(TraceError, match=r"^sizes\.csv line 3: input_tokens -1 is negative"):
        load_rate_windows(path, sizes_path=sizes)


def test_rate_windows_without_a_sizes_file_are_refused(tmp_path):
    path = windows_file(tmp_path, ["0,1", "60,1"], "window_start_s,rate_req_per_s")
    with pytest.raises(TraceError, match=r"^windows\.csv line 1: rate windows need a per-request"):
        load_trace(path)
    with pytest.raises(TraceError, match=r"^windows\.csv line 1: rate windows need"):
        load_rate_windows(path, sizes_path=None)


def test_a_sizes_file_with_a_per_request_trace_is_refused():
    with pytest.raises(TraceError, match=r"line 1: a per-request trace carries its own"):
        load_trace(CODE, sizes_path=CONV)


def test_an_unrecognised_header_lists_both_formats(tmp_path):
    with pytest.raises(TraceError, match=r"^odd\.csv line 1: unrecognised header \(a, b\)"):
        load_trace(write(tmp_path, "odd.csv", "a,b\n1,2\n"))


@pytest.mark.parametrize("scale", [0, -1, float("nan"), float("inf")])
def test_a_scale_that_is_not_positive_is_refused(tmp_path, sizes, scale):
    windows = windows_file(tmp_path, ["0,1", "60,1"], "window_start_s,rate_req_per_s")
    with pytest.raises(TraceError, match=r"^AzureLLMInferenceTrace_code_2023\.csv: scale must"):
        load_trace(CODE, scale=scale)
    with pytest.raises(TraceError, match=r"^windows\.csv: scale must be a finite number > 0"):
        load_rate_windows(windows, sizes_path=sizes, scale=scale)


def test_trace_errors_are_value_errors_that_carry_the_line(tmp_path):
    with pytest.raises(ValueError) as caught:
        load_trace(write(tmp_path, "bad.csv", REQUEST_HEADER + "1,1,1\n0,1,1\n"))
    assert (caught.value.path, caught.value.line) == (str(tmp_path / "bad.csv"), 3)
