"""/metrics answers Prometheus with its bearer token (METRICS_TOKEN), and without one only the
host itself: never an anonymous client from outside (issue 34)."""

import secrets
import time

import httpx
import pytest
from django.test import Client

from tests.support.prometheus_server import prometheus_server

pytestmark = pytest.mark.django_db

TOKEN = secrets.token_urlsafe(32)


def scrape(**meta):
    return Client().get("/metrics", **meta)


def test_without_a_token_an_outside_client_is_refused_and_the_host_itself_answered(settings):
    settings.METRICS_TOKEN = ""
    outside = scrape(REMOTE_ADDR="203.0.113.9")
    assert outside.status_code == 403
    assert b"METRICS_TOKEN" in outside.content
    assert b"controlplane_" not in outside.content

    local = scrape(REMOTE_ADDR="127.0.0.1")
    assert local.status_code == 200
    assert local["Content-Type"].startswith("text/plain")
    assert b"# TYPE " in local.content


@pytest.mark.parametrize(
    "forwarded_for",
    ["203.0.113.9", "127.0.0.1, 203.0.113.9"],
    ids=["the client's address", "the client claiming the loopback"],
)
def test_without_a_token_a_client_through_a_proxy_on_the_same_host_is_refused(
    settings, forwarded_for
):
    """The proxy connects from the loopback; the client is the address it appended."""
    settings.METRICS_TOKEN = ""
    settings.TRUSTED_PROXY_COUNT = 1
    proxied = scrape(REMOTE_ADDR="127.0.0.1", HTTP_X_FORWARDED_FOR=forwarded_for)
    assert proxied.status_code == 403


def test_with_a_token_every_scrape_must_carry_it(settings):
    settings.METRICS_TOKEN = TOKEN
    for meta in (
        {"REMOTE_ADDR": "203.0.113.9"},
        {"REMOTE_ADDR": "127.0.0.1"},  # the token, once set, is asked of the host too
        {"REMOTE_ADDR": "203.0.113.9", "HTTP_AUTHORIZATION": "Bearer " + TOKEN[:-1] + "x"},
        {"REMOTE_ADDR": "203.0.113.9", "HTTP_AUTHORIZATION": TOKEN},
        {"REMOTE_ADDR": "203.0.113.9", "HTTP_AUTHORIZATION": f"Basic {TOKEN}"},
    ):
        refused = scrape(**meta)
        assert refused.status_code == 401, meta
        assert refused["WWW-Authenticate"].startswith("Bearer")
        assert b"# TYPE " not in refused.content

    scraped = scrape(REMOTE_ADDR="203.0.113.9", HTTP_AUTHORIZATION=f"Bearer {TOKEN}")
    assert scraped.status_code == 200
    assert b"# TYPE " in scraped.content


def test_an_api_key_is_not_a_metrics_token(settings, make_key):
    settings.METRICS_TOKEN = TOKEN
    _, plaintext = make_key(service_name="prometheus")
    answer = scrape(REMOTE_ADDR="203.0.113.9", HTTP_AUTHORIZATION=f"Bearer {plaintext}")
    assert answer.status_code == 401


def scrape_health(prometheus_url: str, job: str, *, timeout_seconds: float = 30) -> float:
    """`up` of the job's target once Prometheus has scraped it: 1 answered, 0 refused."""
    deadline = time.monotonic() + timeout_seconds
    while True:
        answer = httpx.get(
            f"{prometheus_url}/api/v1/query", params={"query": f'up{{job="{job}"}}'}, timeout=5
        ).json()
        if answer["data"]["result"]:
            return float(answer["data"]["result"][0]["value"][1])
        assert time.monotonic() < deadline, f"Prometheus never scraped {job}: {answer}"
        time.sleep(0.2)


@pytest.mark.django_db(transaction=True)
def test_a_real_prometheus_scrapes_with_the_token_from_a_file_and_not_without(
    live_server, settings, tmp_path
):
    """The scrape deploy/kubernetes/examples/prometheus-servicemonitor.yaml documents for a
    plain prometheus.yml (`authorization` with `credentials_file`), run by Prometheus itself
    against a running web; the same scrape without the token is refused, even from this host."""
    settings.METRICS_TOKEN = TOKEN
    token_file = tmp_path / "METRICS_TOKEN"
    token_file.write_text(TOKEN)
    target = {"targets": [live_server.url.removeprefix("http://")]}
    jobs = [
        {
            "job_name": "with-token",
            "metrics_path": "/metrics",
            "authorization": {"type": "Bearer", "credentials_file": str(token_file)},
            "static_configs": [target],
        },
        {"job_name": "without-token", "metrics_path": "/metrics", "static_configs": [target]},
    ]
    with prometheus_server([], tmp_path / "prometheus", scrape_configs=jobs) as prometheus_url:
        assert scrape_health(prometheus_url, "with-token") == 1
        assert scrape_health(prometheus_url, "without-token") == 0
