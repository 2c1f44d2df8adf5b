"""What Bearer API key authentication costs per request, in-process, on PostgreSQL.

- me_latency: GET /api/v1/me with a Bearer key, against GET /healthz (no auth, no database):
  the price of authentication (one key lookup) plus a small DRF view.
- list_200_keys_latency: GET /api/v1/api-keys/?page_size=200 listing the customer's 200 keys,
  against GET /api/v1/me with the same key: the price of serializing a page of keys.

last_used_at is written at most once per 60 s, so after the warm-up every request is a read.
The test client keeps its database connection between requests, so no figure includes connecting.
"""

from rest_framework.test import APIClient

from accounts.services import api_key_create, customer_create
from bench.figures import Figure
from bench.timing import median_latencies

KEYS = 200
ME = "/api/v1/me"
HEALTHZ = "/healthz"
LIST = f"/api/v1/api-keys/?page_size={KEYS}"

MS = 1000.0


def _fixture() -> str:
    customer = customer_create(name="Bench API auth", slug="bench-api-auth")
    plaintext = api_key_create(name="bench key", customer=customer).plaintext
    for number in range(1, KEYS):
        api_key_create(name=f"bench key {number}", customer=customer)
    return plaintext


def _get(client: APIClient, path: str):
    def call():
        response = client.get(path)
        if response.status_code != 200:
            raise AssertionError(f"GET {path} answered {response.status_code}: {response.content}")
        return response

    return call


def run() -> list[Figure]:
    plaintext = _fixture()
    anonymous = APIClient()
    keyed = APIClient()
    keyed.credentials(HTTP_AUTHORIZATION=f"Bearer {plaintext}")

    healthz, me, listing = _get(anonymous, HEALTHZ), _get(keyed, ME), _get(keyed, LIST)
    body = listing().json()
    if body["count"] != KEYS or len(body["results"]) != KEYS:
        raise AssertionError(f"expected {KEYS} keys on one page, got {body['count']}")

    auth = median_latencies({"healthz": healthz, "me": me}, iterations=100, rounds=5)
    lists = median_latencies({"me": me, "list": listing}, iterations=60, rounds=5, warmup=10)
    return [
        Figure(
            name="me_latency",
            value=auth["me"] * MS,
            unit="ms/request",
            baseline=auth["healthz"] * MS,
            baseline_name=f"GET {HEALTHZ}",
        ),
        Figure(
            name=f"list_{KEYS}_keys_latency",
            value=lists["list"] * MS,
            unit="ms/request",
            baseline=lists["me"] * MS,
            baseline_name=f"GET {ME}",
        ),
    ]
