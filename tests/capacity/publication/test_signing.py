"""Signed publications (docs/gateway-contract.md, "Signed publications"): what the control
plane's publisher writes verifies under the public half a gateway holds, through a rotation
with two keys valid, and nothing else does."""

import pytest
import redis
from django.core.management import call_command
from django.core.management.base import CommandError

from capacity.admission import gate as admission
from capacity.publication import signing
from capacity.publication.publish import publish_gateway_state
from dataplane.gateway.contract import (
    CUSTOMER_TIERS,
    CUSTOMERS,
    ENTITLEMENTS,
    KEYS,
    META,
    MODELS,
    RESERVATIONS,
    ContractReader,
)

pytestmark = pytest.mark.django_db

DOCUMENTS = (KEYS, MODELS, ENTITLEMENTS, CUSTOMERS, CUSTOMER_TIERS, RESERVATIONS)


@pytest.fixture
def published(settings, sellable, acme, make_key):
    """Publish with the settings' key and read back what a gateway reads."""
    admission.reset()
    client = redis.Redis.from_url(settings.ADMISSION_REDIS_URL)
    make_key(customer=acme)

    def publish():
        assert publish_gateway_state(reason="test") is not None
        return {name: client.hgetall(name) for name in DOCUMENTS}, client.hgetall(META)

    yield publish
    admission.reset()


def refusal(public_spec: str, documents, meta, *, held: tuple[int, float] | None = None):
    reader = ContractReader(
        None,  # type: ignore[arg-type]  # refusal() reads nothing
        refresh_seconds=1,
        publication_keys=signing.parse_public_keys(public_spec),
    )
    if held is not None:
        from dataplane.gateway.contract import Contract

        reader.contract = Contract(version=held[0], published_at=held[1])
    return reader.refusal(documents, meta)


def test_what_the_publisher_signs_verifies_under_its_public_half_and_no_other(settings, published):
    old_private, old_public = signing.generate("old")
    new_private, new_public = signing.generate("new")
    settings.PUBLICATION_SIGNING_KEY = old_private
    documents, meta = published()
    assert b"signature" in meta
    assert refusal(old_public, documents, meta) is None
    assert refusal(new_public, documents, meta)[0] == "signature"

    # Any field changed after signing, or a document added, is refused.
    tampered = {**documents, KEYS: {**documents[KEYS], b"mu0000forged00": b"{}"}}
    assert refusal(old_public, tampered, meta)[0] == "signature"
    assert refusal(old_public, documents, {**meta, b"admission_burst_seconds": b"1e9"})[0] == (
        "signature"
    )
    assert refusal(old_public, documents, {k: v for k, v in meta.items() if k != b"signature"})[
        0
    ] == ("unsigned")

    # A rotation: gateways hold both public keys, the control plane switches to the new one,
    # then the old one is dropped.
    both = f"{old_public},{new_public}"
    assert refusal(both, documents, meta) is None
    settings.PUBLICATION_SIGNING_KEY = new_private
    documents, meta = published()
    assert meta[b"signature"].startswith(b"new:")
    assert refusal(both, documents, meta) is None
    assert refusal(new_public, documents, meta) is None
    assert refusal(old_public, documents, meta)[0] == "signature"


def test_a_gateway_takes_a_newer_publication_and_refuses_an_older_one(settings, published):
    private, public = signing.generate("k1")
    settings.PUBLICATION_SIGNING_KEY = private
    first = published()
    second = published()
    version = int(second[1][b"version"])
    published_at = float(second[1][b"published_at"])
    assert refusal(public, *second, held=(version - 1, published_at - 0.01)) is None
    assert refusal(public, *first, held=(version, published_at))[0] == "replay"
    # Redis lost its data: the versions start again, and a clearly later publication is taken.
    assert refusal(public, *second, held=(version + 100, published_at - 60)) is None
    # A publication captured long ago is a replay whatever its version.
    assert refusal(public, *second, held=(1, published_at + 60))[0] == "replay"


def test_an_unsigned_publication_is_taken_by_a_gateway_without_keys(settings, published):
    settings.PUBLICATION_SIGNING_KEY = ""
    settings.DEBUG = True  # unsigned is for development only
    documents, meta = published()
    assert b"signature" not in meta
    assert refusal("", documents, meta) is None
    _, public = signing.generate("k1")
    assert refusal(public, documents, meta)[0] == "unsigned"


def test_the_command_makes_a_pair_that_signs_and_verifies(capsys, settings):
    call_command("publication_keys", "new", "--id", "2027-01")
    lines = dict(line.split("=", 1) for line in capsys.readouterr().out.split())
    private, public = lines["PUBLICATION_SIGNING_KEY"], lines["GATEWAY_PUBLICATION_KEYS"]
    key_id, key = signing.parse_private_key(private)
    content = signing.digest({KEYS: {"a": "b"}}, {"published_at": "1", "version": "1"})
    assert signing.verify(
        signing.parse_public_keys(public), signing.sign(key_id, key, content), content
    )
    settings.PUBLICATION_SIGNING_KEY = private
    call_command("publication_keys", "public")
    assert capsys.readouterr().out.strip() == public
    with pytest.raises(CommandError, match="letters, digits or '-'"):
        call_command("publication_keys", "new", "--id", "no spaces")


def test_the_acl_command_prints_an_aclfile_redis_loads(capsys, monkeypatch, tmp_path):
    """`manage.py redis_acl print` writes the file a Redis starts with: the control plane's
    password opens everything, the gateway's only what gateways write."""
    import subprocess

    from tests.dataplane.gateway.conftest import wait_for
    from tests.support.processes import free_port

    with pytest.raises(CommandError, match="REDIS_ACL_CONTROL_PLANE_PASSWORD"):
        call_command("redis_acl", "print")
    monkeypatch.setenv("REDIS_ACL_CONTROL_PLANE_PASSWORD", "c" * 32)
    monkeypatch.setenv("REDIS_ACL_GATEWAY_PASSWORD", "short")
    with pytest.raises(CommandError, match="gateway's Redis password must be 32"):
        call_command("redis_acl", "print")
    monkeypatch.setenv("REDIS_ACL_GATEWAY_PASSWORD", "g" * 32)
    call_command("redis_acl", "print")
    aclfile = tmp_path / "users.acl"
    aclfile.write_text(capsys.readouterr().out)
    port = free_port()
    server = subprocess.Popen(
        ["redis-server", "--port", str(port), "--save", "", "--aclfile", str(aclfile)],
        stdout=subprocess.DEVNULL,
    )
    try:
        owner = redis.Redis(port=port, username="controlplane", password="c" * 32)
        wait_for(lambda: _pings(owner))
        owner.hset(KEYS, "mu0000000000", "{}")
        gateway = redis.Redis(port=port, username="gateway", password="g" * 32)
        assert gateway.hgetall(KEYS) == {b"mu0000000000": b"{}"}
        gateway.xadd("gw:v1:spool", {"events": "[]"})
        with pytest.raises(redis.exceptions.NoPermissionError):
            gateway.hset(KEYS, "mu0000forged", "{}")
    finally:
        server.terminate()
        server.wait(timeout=10)


def _pings(client) -> bool:
    try:
        return bool(client.ping())
    except redis.ConnectionError:
        return False
