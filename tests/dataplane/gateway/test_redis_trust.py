"""Redis as a trust boundary (issue 34, finding 9): write access to Redis is no way around the
control plane.

- The gateway's Redis user (capacity/publication/redis_acl.py) reads the publications and
  writes only what gateways write; the real gateway serves through it.
- A publication the control plane did not sign is refused, and so is an old one replayed.
- A spool entry without the gateway's seal is dropped, never posted under its service key.

Each runs against a Redis of its own, started with the ACL users a deployment gets.
"""

from __future__ import annotations

import json
import secrets
import subprocess
import uuid

import httpx
import pytest
import redis

from accounts.keys import mint
from capacity.publication.redis_acl import CONTROL_PLANE_USER, GATEWAY_USER, acl_lines
from tests.dataplane.gateway import contract as C
from tests.dataplane.gateway.conftest import bearer, set_limits, wait_for
from tests.support.processes import free_port

BODY = {"model": "tiny", "prompt": "hello there", "max_tokens": 4}


@pytest.fixture
def acl_redis(tmp_path):
    """A Redis of the test's own with the deployment's users: (control plane URL, gateway
    URL)."""
    passwords = {name: secrets.token_urlsafe(32) for name in ("cp", "gw")}
    aclfile = tmp_path / "users.acl"
    lines = acl_lines(control_plane_password=passwords["cp"], gateway_password=passwords["gw"])
    aclfile.write_text("\n".join(lines) + "\n")
    port = free_port()
    process = subprocess.Popen(
        [
            "redis-server",
            "--port",
            str(port),
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(tmp_path),
            "--aclfile",
            str(aclfile),
        ],  # fmt: skip
        stdout=subprocess.DEVNULL,
    )
    control_plane = f"redis://{CONTROL_PLANE_USER}:{passwords['cp']}@127.0.0.1:{port}/0"
    gateway = f"redis://{GATEWAY_USER}:{passwords['gw']}@127.0.0.1:{port}/0"

    def pings() -> bool:
        try:
            return bool(redis.Redis.from_url(control_plane).ping())
        except redis.ConnectionError:
            return False

    wait_for(pings)
    try:
        yield control_plane, gateway
    finally:
        process.terminate()
        process.wait(timeout=10)


def served(acl_redis, start_emulator, start_gateway, **env):
    """acme's key and model `tiny` published by the control plane's user, and a gateway that
    reads and admits as the gateway user."""
    control_plane_url, gateway_url = acl_redis
    owner = redis.Redis.from_url(control_plane_url)
    engine, _ = start_emulator()
    acme = C.key(customer_id=1, customer="acme")
    publication = C.Publication(
        keys={acme.prefix: acme.doc},
        models={"tiny": C.model(7, [C.replica(engine)])},
        entitlements={1: ["tiny"]},
    )
    version = C.publish(owner, publication)
    set_limits(owner, {(1, 7): (1000.0, 1000.0)})
    gateway = start_gateway(GATEWAY_REDIS_URL=gateway_url, **env)
    return owner, publication, acme, gateway, version


def refused_publications(http: httpx.Client, gateway) -> dict[str, float]:
    counts: dict[str, float] = {}
    for line in http.get(gateway.url + "/metrics").text.splitlines():
        if line.startswith("gateway_publications_refused_total{"):
            reason = line.split('reason="', 1)[1].split('"', 1)[0]
            counts[reason] = float(line.rsplit(" ", 1)[1])
    return counts


def test_the_gateway_user_serves_yet_writes_nothing_the_control_plane_owns(
    acl_redis, start_emulator, start_gateway, http
):
    owner, _, acme, gateway, _ = served(acl_redis, start_emulator, start_gateway)
    # The real path under the ACL: the contract read, admission's scripts, the record and the
    # worker's heartbeat written as the gateway user.
    response = http.post(gateway.url + "/v1/completions", json=BODY, headers=bearer(acme))
    assert response.status_code == 200, response.text
    assert owner.hlen("gw:v1:workers") >= 1
    assert list(owner.scan_iter(match="adm:req:7:1:*"))

    as_gateway = redis.Redis.from_url(acl_redis[1])
    forged = mint()
    refused = {
        "a forged key": lambda: as_gateway.hset("gw:v1:keys", forged.prefix, "{}"),
        "a new version": lambda: as_gateway.hincrby("gw:v1:meta", "version", 1),
        "a reservation floor": lambda: as_gateway.hset("adm:floor:7:1", "g", "1e9"),
        "the tick's heartbeat": lambda: as_gateway.set("adm:lim:tick", "0"),
        "a best-effort allowance": lambda: as_gateway.hset("adm:lim:7:1", "be", "1e9"),
        "a request limit": lambda: as_gateway.hset("adm:rl:c:1", "rpm", "1e9"),
        "the Celery broker": lambda: as_gateway.lpush("celery", "{}"),
        "FLUSHDB": lambda: as_gateway.flushdb(),
        "CONFIG SET": lambda: as_gateway.config_set("appendonly", "no"),
        "KEYS": lambda: as_gateway.keys("*"),
        "SCRIPT FLUSH": lambda: as_gateway.script_flush(),
        # A script runs as its caller: no way around the key patterns.
        "a script writing a floor": lambda: as_gateway.eval(
            "return redis.call('HSET', 'adm:floor:7:1', 'g', '1e9')", 0
        ),
    }
    refusal = "NOPERM|no permissions|can.t access"
    for what, attempt in refused.items():
        with pytest.raises(redis.exceptions.ResponseError, match=refusal):
            attempt()
            pytest.fail(f"the gateway user could write {what}")
    # What gateways do write stays writable.
    as_gateway.hset("gw:v1:waiting", "tiny", json.dumps({"requests": 0}))
    as_gateway.hgetall("gw:v1:keys")
    assert owner.hget("adm:floor:7:1", "g") == b"1000.0"  # as the control plane wrote it


def test_a_key_forged_in_redis_is_refused_and_an_old_publication_replayed_too(
    acl_redis, start_emulator, start_gateway, http
):
    owner, publication, acme, gateway, version = served(acl_redis, start_emulator, start_gateway)
    wait_for(lambda: http.get(gateway.url + "/healthz").json()["contract_version"] == version)
    # Whoever can write the publications (the control plane's Redis password, not its signing
    # key) adds a key of their own and bumps the version.
    forged = C.key(customer_id=1, customer="acme")
    owner.hset("gw:v1:keys", forged.prefix, json.dumps(forged.doc))
    owner.hincrby("gw:v1:meta", "version", 1)
    wait_for(lambda: refused_publications(http, gateway).get("signature", 0) >= 1)
    assert (
        http.post(gateway.url + "/v1/completions", json=BODY, headers=bearer(forged)).status_code
        == 401
    )
    assert (
        http.post(gateway.url + "/v1/completions", json=BODY, headers=bearer(acme)).status_code
        == 200
    )

    # An old publication, validly signed, replayed after the key it lists was revoked.
    C.publish(owner, publication)
    old = {name: owner.hgetall(name) for name in ("gw:v1:keys", "gw:v1:models",
                                                   "gw:v1:entitlements", "gw:v1:meta")}  # fmt: skip
    publication.keys[acme.prefix] = {**acme.doc, "revoked": True}
    revoked_version = C.publish(owner, publication)
    wait_for(
        lambda: http.get(gateway.url + "/healthz").json()["contract_version"] >= revoked_version
    )
    assert (
        http.post(gateway.url + "/v1/completions", json=BODY, headers=bearer(acme)).status_code
        == 401
    )
    pipe = owner.pipeline(transaction=True)
    for name, fields in old.items():
        pipe.delete(name)
        pipe.hset(name, mapping=fields)
    pipe.execute()
    wait_for(lambda: refused_publications(http, gateway).get("replay", 0) >= 1)
    assert (
        http.post(gateway.url + "/v1/completions", json=BODY, headers=bearer(acme)).status_code
        == 401
    )
    assert "is not newer than the copy held" in gateway.log()
    # Nor does bumping the replayed copy's version help: the version is signed.
    owner.hincrby("gw:v1:meta", "version", 10)
    wait_for(lambda: refused_publications(http, gateway).get("signature", 0) >= 2)
    assert (
        http.post(gateway.url + "/v1/completions", json=BODY, headers=bearer(acme)).status_code
        == 401
    )


def test_a_spool_entry_forged_by_a_redis_writer_is_never_posted(
    acl_redis, start_emulator, start_gateway, usage_server, http
):
    owner, _, acme, gateway, _ = served(acl_redis, start_emulator, start_gateway)
    # The control plane down: the real event goes to the spool, sealed.
    usage_server.status = 503
    response = http.post(gateway.url + "/v1/completions", json=BODY, headers=bearer(acme))
    assert response.status_code == 200
    wait_for(lambda: owner.xlen("gw:v1:spool") >= 1)
    # The gateway's own Redis password may add to the spool, but without the service key it
    # cannot seal: a globex event posted under the gateway's key would be billed.
    forged_id = f"forged-{uuid.uuid4()}"
    forged = {
        "event_id": forged_id,
        "customer": "globex",
        "model": "tiny",
        "input_tokens": 100000,
        "output_tokens": 100000,
        "outcome": "completed",
    }
    as_gateway = redis.Redis.from_url(acl_redis[1])
    as_gateway.xadd("gw:v1:spool", {"events": json.dumps([forged])})
    as_gateway.xadd(
        "gw:v1:spool",
        {"events": json.dumps([forged]), "sealer": "0" * 16, "seal": "0" * 64},
    )
    usage_server.status = 200

    def posted_ids() -> list[str]:
        return [
            event["event_id"]
            for request in list(usage_server.requests)
            if request.path == "/api/v1/usage/events"
            for event in json.loads(request.body)["events"]
        ]

    real_id = response.headers["X-Request-Id"]
    wait_for(lambda: posted_ids().count(real_id) >= 2)  # once refused (503), once delivered
    wait_for(lambda: "no valid seal; dropped" in gateway.log())
    assert forged_id not in posted_ids()
    # The entry with another gateway's sealer is left to it; the unsealed one is gone.
    remaining = [fields for _, fields in owner.xrange("gw:v1:spool")]
    assert [f.get(b"sealer") for f in remaining] == [b"0" * 16]
