"""The tenants file: what it accepts, and a one-line reason naming the entry and field for what it does not."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from cache_service.core import KVCacheError, Reason
from cache_service.rpc.identity import (
    ANONYMOUS,
    Identities,
    Identity,
    Role,
    TenantsFileError,
    load_tenants,
    parse_tenants,
)

TOKEN = "t" * 16


def entry(**fields: Any) -> dict[str, Any]:
    return {"name": "alice", "token": TOKEN, "role": "engine", "cache_salts": ["a"], **fields}


def test_a_valid_file_gives_each_token_its_identity(tmp_path: Path) -> None:
    path = tmp_path / "tenants.yaml"
    path.write_text(f"""
tenants:
  - name: alice
    token: {TOKEN}
    role: engine
    cache_salts: [alice, alice-eval]
    max_sessions: 100
  - name: ops
    token: {"o" * 20}
    role: admin
""")
    who = load_tenants(str(path))
    assert who.names == ("alice", "ops")
    assert who.resolve(f"Bearer {TOKEN}".encode()) == Identity("alice", Role.ENGINE, ("alice", "alice-eval"), 100)
    assert who.resolve(b"Bearer " + b"o" * 20) == Identity("ops", Role.ADMIN, ("*",), 0)
    for bad in (b"", b"Bearer ", TOKEN.encode(), b"Bearer " + TOKEN.encode() + b"x", b"Basic " + TOKEN.encode()):
        with pytest.raises(KVCacheError) as err:
            who.resolve(bad)
        assert err.value.reason is Reason.BAD_TOKEN


def test_no_tokens_means_everyone_is_the_anonymous_admin() -> None:
    assert Identities().resolve(b"") is ANONYMOUS
    assert Identities().resolve(b"Bearer whatever") is ANONYMOUS
    single = Identities.single_token("s3cret")
    assert single.resolve(b"Bearer s3cret") == Identity("admin", Role.ADMIN)


def test_salt_resolution() -> None:
    alice = Identity("alice", Role.ENGINE, ("alice", "alice-eval"))
    assert (alice.salt(""), alice.salt("alice"), alice.salt("alice-eval")) == ("alice", "alice", "alice-eval")
    with pytest.raises(KVCacheError) as err:
        alice.salt("bob")
    assert (err.value.reason, err.value.metadata) == (Reason.SALT_NOT_ALLOWED, {"cache_salt": "bob"})
    anyone = Identity("ops", Role.ADMIN)
    assert (anyone.salt(""), anyone.salt("bob")) == ("", "bob")
    default_then_any = Identity("x", Role.ENGINE, ("x", "*"))
    assert (default_then_any.salt(""), default_then_any.salt("y")) == ("x", "y")


@pytest.mark.parametrize(("doc", "message"), [
    (None, "top level: must be a mapping with one key, 'tenants', holding a list of identities"),
    ({"tenants": []}, "tenants: is empty: list at least one identity"),
    ({"tenants": [entry()], "extra": 1}, "top level: must be a mapping with one key, 'tenants'"),
    ({"tenants": ["alice"]}, "tenants[0]: must be a mapping"),
    ({"tenants": [entry(colour="red")]}, "tenants[0]: unknown key(s) colour; known: cache_salts, max_sessions, "
                                         "name, role, token"),
    ({"tenants": [entry(name="")]}, "tenants[0].name: must be a non-empty string of at most 128 characters"),
    ({"tenants": [entry(), entry(token="u" * 16)]}, "tenants[1].name: 'alice' appears twice"),
    ({"tenants": [entry(token="short")]}, "tenants[0].token: must be a string of at least 16 characters"),
    ({"tenants": [entry(), entry(name="bob")]}, "tenants[1].token: is the same as 'alice''s"),
    ({"tenants": [entry(role="god")]}, "tenants[0].role: 'god' is not one of engine, admin, reader"),
    ({"tenants": [{"name": "a", "token": TOKEN}]}, "tenants[0].cache_salts: is required for an engine identity"),
    ({"tenants": [entry(cache_salts=[])]}, "tenants[0].cache_salts: must be a non-empty list of strings"),
    ({"tenants": [entry(cache_salts="a")]}, "tenants[0].cache_salts: must be a non-empty list of strings"),
    ({"tenants": [entry(cache_salts=["s" * 300])]}, "tenants[0].cache_salts: cache_salt: longer than"),
    ({"tenants": [entry(max_sessions=-1)]}, "tenants[0].max_sessions: must be an integer >= 0, got -1"),
    ({"tenants": [entry(max_sessions=True)]}, "tenants[0].max_sessions: must be an integer >= 0, got True"),
])
def test_an_invalid_file_names_the_entry_and_field(doc: Any, message: str) -> None:
    with pytest.raises(TenantsFileError) as err:
        parse_tenants(doc, "t.yaml")
    assert str(err.value).startswith(f"t.yaml: {message}")
    assert "\n" not in str(err.value)


def test_unreadable_or_not_yaml(tmp_path: Path) -> None:
    with pytest.raises(TenantsFileError, match=r"^/nonexistent\.yaml: No such file or directory$"):
        load_tenants("/nonexistent.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("tenants: [\n")
    with pytest.raises(TenantsFileError, match=r"bad\.yaml: not valid YAML \("):
        load_tenants(str(bad))
