"""Who is calling: identities from bearer tokens, their roles, and the cache salts each may name.

An identity is a `name` (what sessions and engine ids belong to), a `role` and the `cache_salts` it may
use, the first being its default (applied when a request names none; "*" allows any salt). Roles:

    engine   open and drive its own sessions, hold its own engine leases; sees only its own sessions
    admin    everything, on anyone's sessions and engines (operator RPCs: ReapSessions, GetStats verify)
    reader   read-only: pool info, stats, prefix probes within its salts, session metadata without tokens

Sources: `--tenants-file` (YAML, many identities), or `--auth-token` (one admin identity named "admin"),
or neither (everyone is the anonymous admin "", for a loopback or unix-socket service). Tokens are looked
up by their SHA-256 digest, so the lookup's timing says nothing about a token's bytes.
"""

from __future__ import annotations

import enum
import hashlib
from dataclasses import dataclass
from typing import Any

from cache_service.core import KVCacheError, Reason
from cache_service.core.validate import check_salt

ANY_SALT = "*"


class Role(enum.Enum):
    ENGINE = "engine"
    ADMIN = "admin"
    READER = "reader"


@dataclass(frozen=True, slots=True)
class Identity:
    name: str
    role: Role
    cache_salts: tuple[str, ...] = (ANY_SALT,)
    """Salts it may name; the first is its default ("*": any, the default then being "")."""
    max_sessions: int = 0
    """Sessions it may have open at once (0: only --max-sessions bounds it)."""

    @property
    def is_admin(self) -> bool:
        return self.role is Role.ADMIN

    @property
    def owner(self) -> str | None:
        """The identity the core checks ownership against: None for an admin, who acts on anyone's."""
        return None if self.role is Role.ADMIN else self.name

    @property
    def sees(self) -> str | None:
        """Whose sessions it may list and inspect: only its own for an engine identity, all otherwise."""
        return self.name if self.role is Role.ENGINE else None

    def salt(self, requested: str) -> str:
        """The salt a request uses: `requested`, or the default when empty. SALT_NOT_ALLOWED otherwise."""
        if not requested:
            default = self.cache_salts[0]
            return "" if default == ANY_SALT else default
        if requested in self.cache_salts or ANY_SALT in self.cache_salts:
            return requested
        raise KVCacheError(Reason.SALT_NOT_ALLOWED,
                           f"identity {self.name!r} may not use cache_salt {requested!r}", cache_salt=requested)

    def need(self, *roles: Role, what: str) -> None:
        """ROLE_REQUIRED unless this identity has one of `roles`."""
        if self.role not in roles:
            names = " or ".join(r.value for r in roles)
            raise KVCacheError(Reason.ROLE_REQUIRED,
                               f"{what} needs the {names} role; identity {self.name!r} is {self.role.value}",
                               role=self.role.value, required=names)


ANONYMOUS = Identity("", Role.ADMIN)
"""Everyone, when the service has no tokens (a loopback or unix-socket service, one trust domain)."""


def token_key(token: str | bytes) -> bytes:
    raw = token.encode() if isinstance(token, str) else token
    return hashlib.sha256(raw).digest()


class Identities:
    """Bearer token -> Identity. Empty: no tokens, every caller is ANONYMOUS."""

    def __init__(self, by_token: dict[str, Identity] | None = None) -> None:
        self._by_key = {token_key(t): ident for t, ident in (by_token or {}).items()}
        self.names = tuple(sorted(i.name for i in (by_token or {}).values()))

    @property
    def open(self) -> bool:
        return not self._by_key

    @classmethod
    def single_token(cls, token: str) -> Identities:
        """`--auth-token`: one admin identity, "admin", allowed every salt."""
        return cls({token: Identity("admin", Role.ADMIN)})

    def resolve(self, authorization: bytes) -> Identity:
        """The identity of an `authorization: Bearer <token>` header value; BAD_TOKEN when unknown."""
        if not self._by_key:
            return ANONYMOUS
        prefix = b"Bearer "
        ident = self._by_key.get(token_key(authorization[len(prefix):])) if authorization.startswith(prefix) else None
        if ident is None:
            raise KVCacheError(Reason.BAD_TOKEN, "missing or wrong 'authorization: Bearer <token>' metadata")
        return ident


class TenantsFileError(ValueError):
    """The tenants file is unreadable or invalid; the message is one line naming the entry and field."""


_KEYS = {"name", "token", "role", "cache_salts", "max_sessions"}


def parse_tenants(doc: Any, source: str) -> Identities:
    """Identities from a parsed tenants document: `{tenants: [{name, token, role, cache_salts,
    max_sessions}]}`. Names and tokens are unique; `cache_salts` defaults to ["*"] for admin and reader
    and is required for an engine identity."""
    def bad(where: str, why: str) -> TenantsFileError:
        return TenantsFileError(f"{source}: {where}: {why}")

    if not isinstance(doc, dict) or set(doc) != {"tenants"} or not isinstance(doc["tenants"], list):
        raise bad("top level", "must be a mapping with one key, 'tenants', holding a list of identities")
    if not doc["tenants"]:
        raise bad("tenants", "is empty: list at least one identity")
    by_token: dict[str, Identity] = {}
    names: set[str] = set()
    for i, entry in enumerate(doc["tenants"]):
        where = f"tenants[{i}]"
        if not isinstance(entry, dict):
            raise bad(where, "must be a mapping")
        unknown = set(entry) - _KEYS
        if unknown:
            raise bad(where, f"unknown key(s) {', '.join(sorted(map(str, unknown)))}; "
                             f"known: {', '.join(sorted(_KEYS))}")
        name, token, role = entry.get("name"), entry.get("token"), entry.get("role", "engine")
        if not isinstance(name, str) or not name or len(name) > 128:
            raise bad(f"{where}.name", "must be a non-empty string of at most 128 characters")
        if name in names:
            raise bad(f"{where}.name", f"{name!r} appears twice")
        if not isinstance(token, str) or len(token) < 16:
            raise bad(f"{where}.token", "must be a string of at least 16 characters")
        if token in by_token:
            raise bad(f"{where}.token", f"is the same as {by_token[token].name!r}'s")
        if role not in {r.value for r in Role}:
            raise bad(f"{where}.role", f"{role!r} is not one of {', '.join(r.value for r in Role)}")
        salts = entry.get("cache_salts", None if role == "engine" else [ANY_SALT])
        if salts is None:
            raise bad(f"{where}.cache_salts", "is required for an engine identity (its first salt is its default)")
        if not isinstance(salts, list) or not salts or not all(isinstance(s, str) for s in salts):
            raise bad(f"{where}.cache_salts", "must be a non-empty list of strings")
        for s in salts:
            if s != ANY_SALT:
                try:
                    check_salt(s)
                except KVCacheError as e:
                    raise bad(f"{where}.cache_salts", e.message) from None
        quota = entry.get("max_sessions", 0)
        if isinstance(quota, bool) or not isinstance(quota, int) or quota < 0:
            raise bad(f"{where}.max_sessions", f"must be an integer >= 0, got {quota!r}")
        names.add(name)
        by_token[token] = Identity(name, Role(role), tuple(salts), quota)
    return Identities(by_token)


def load_tenants(path: str) -> Identities:
    """Read and check a tenants file (YAML). TenantsFileError with a one-line reason on any problem."""
    import yaml  # only a service with a tenants file needs it

    try:
        with open(path, encoding="utf-8") as f:
            doc = yaml.safe_load(f)
    except OSError as e:
        raise TenantsFileError(f"{path}: {e.strerror}") from None
    except yaml.YAMLError as e:
        raise TenantsFileError(f"{path}: not valid YAML ({str(e).splitlines()[0]})") from None
    return parse_tenants(doc, path)
