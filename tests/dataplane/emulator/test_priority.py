"""vLLM's scheduling policies on a saturated replica: fcfs, priority, priority preemption.

Four low-priority (priority=1) requests fill the batch (max_num_seqs=4) and four more wait;
then a priority=0 probe arrives. Each low request runs ~1 s (200 tokens of 5 ms steps).
"""

import pytest

from tests.support.processes import emulator_process

from .support import metric, model, scrape, start_streams, wait_for_samples

# Measures real throughput and latency: runs alone, not beside another test worker.
pytestmark = pytest.mark.serial

LOW = {"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 200, "ignore_eos": True, "priority": 1}
PROBE = {
    "model": "tiny",
    "prompt": "The capital of France is",
    "max_tokens": 4,
    "temperature": 0,
    "priority": 0,
}
CONFIG = {"models": [model(max_num_seqs=4, decode_step_base_seconds=0.005)]}
# The probe gets its first token one step after a slot frees; the streams are read by
# clients on different threads, so on a loaded machine a read can come a little late. The
# alternatives these tests rule out differ by ~1 s.
SLACK_SECONDS = 0.2


def _saturate_then_probe(http, url, low_request=LOW):
    low = start_streams(url, [low_request] * 8)
    wait_for_samples(
        http,
        url,
        lambda s: (
            (
                metric(s, "vllm:num_requests_running", model_name="tiny"),
                metric(s, "vllm:num_requests_waiting", model_name="tiny"),
            )
            == (4, 4)
        ),
    )
    (probe,) = start_streams(url, [PROBE]).result(timeout=30)
    low_results = low.result(timeout=30)
    assert probe.status == 200
    assert all(len(r.token_events) == 200 for r in low_results)
    # The four that ran first, and the four that waited for them.
    by_start = sorted(low_results, key=lambda r: r.token_seconds[0])
    return probe, by_start[:4], by_start[4:], scrape(http, url)


def _preemptions(samples) -> float:
    return metric(samples, "vllm:num_preemptions_total", model_name="tiny")


def test_under_fcfs_the_probe_waits_behind_everything(tmp_path, http):
    # As vLLM under fcfs, the emulator refuses a non-zero priority, so the traffic sends none.
    unprioritised = {key: value for key, value in LOW.items() if key != "priority"}
    with emulator_process(CONFIG, tmp_path) as url:
        probe, _first, waited, samples = _saturate_then_probe(http, url, unprioritised)

    # Arrival order only: the probe came last, so it waits for a slot after the four
    # waiting requests took theirs, i.e. for one of them to finish (~2 s in).
    # (Clients read their streams on different threads: allow for a late read, not a second.)
    assert probe.token_seconds[0] > min(r.token_seconds[-1] for r in waited) - SLACK_SECONDS
    assert _preemptions(samples) == 0


def test_under_the_priority_policy_the_probe_jumps_the_queue_but_waits_for_a_slot(tmp_path, http):
    args = ("--scheduling-policy", "priority")
    with emulator_process(CONFIG, tmp_path, args=args) as url:
        probe, first, waited, samples = _saturate_then_probe(http, url)

    # vLLM V1: ahead of the waiting low-priority requests (it gets the first free slot, ~1 s
    # in, not one after them, ~2 s in), but nothing running is preempted for it.
    assert probe.token_seconds[0] > min(r.token_seconds[-1] for r in first) - SLACK_SECONDS
    assert probe.token_seconds[0] < min(r.token_seconds[-1] for r in waited) - 0.5
    assert _preemptions(samples) == 0


def test_priority_preemption_runs_the_probe_at_once_and_counts_the_preemption(tmp_path, http):
    args = ("--scheduling-policy", "priority", "--priority-preemption")
    with emulator_process(CONFIG, tmp_path, args=args) as url:
        probe, first, waited, samples = _saturate_then_probe(http, url)

    # Well before any running request could finish (~1 s): one was preempted for it.
    assert probe.ttft_seconds < 0.4
    assert probe.token_seconds[-1] < min(r.token_seconds[-1] for r in first)
    assert _preemptions(samples) == 1
    # The preempted request resumed (recompute) and still produced all its tokens, in order;
    # and the four waiting ones were not overtaken by it.
    victim = max(first, key=lambda r: r.token_seconds[-1])
    gaps = [b - a for a, b in zip(victim.token_seconds, victim.token_seconds[1:], strict=False)]
    assert max(gaps) > 0.015  # it stood still while the probe ran
    assert all(r.token_seconds[0] > victim.token_seconds[0] for r in waited)


@pytest.mark.parametrize(
    "args",
    [("--priority-preemption",), ("--scheduling-policy", "sjf")],
)
def test_bad_policy_flags_are_refused(tmp_path, args):
    import json
    import subprocess
    import sys

    from tests.support.processes import ROOT

    path = tmp_path / "c.json"
    path.write_text(json.dumps(CONFIG))
    done = subprocess.run(
        [sys.executable, "-m", "dataplane.emulator", "--port", "1", "--config", str(path)]
        + list(args),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 2
    assert args[0] in done.stderr
