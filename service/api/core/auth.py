"""Bearer tokens: created by ``trainq token create``, stored only as a sha256 hash.

A token's name is the owner of the jobs it submits; it sees and cancels only those (others'
jobs answer 404, as if they did not exist), and an admin token sees all. Lookups are cached
for ``token_cache_s`` so the hot GET path does not pay a query per request; a revoked token
stops working within that time.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING

from sqlalchemy import Connection, select, update
from sqlalchemy.orm import Session

from service.api.core.errors import Unauthorized
from service.api.core.models import ApiToken, utcnow
from service.api.core.ttlcache import TtlCache

if TYPE_CHECKING:
    from service.api.core.db import AsyncReader

__all__ = [
    "ANONYMOUS",
    "Principal",
    "TokenCache",
    "create_token",
    "hash_token",
    "list_tokens",
    "owner_principal",
    "revoke_tokens",
]

TOKEN_PREFIX = "tq_"


@dataclass(frozen=True)
class Principal:
    name: str
    admin: bool = False

    def can_see(self, owner: str) -> bool:
        return self.admin or hmac.compare_digest(owner, self.name)


# With TRAINQ_AUTH=off every caller is this one admin.
ANONYMOUS = Principal("anonymous", admin=True)


def owner_principal(conn: Connection | Session, owner: str, auth_enabled: bool) -> Principal:
    """The principal an owner acts as when no request carries its token (a sweep's trials,
    made by the sweeper): an admin while it holds a live admin token (tokens may share a
    name), so a revoked admin token stops giving its sweeps admin rights; every owner is an
    admin with TRAINQ_AUTH=off, as every caller is then."""
    if not auth_enabled:
        return Principal(owner, admin=True)
    admin = conn.execute(
        select(ApiToken.id)
        .where(ApiToken.name == owner, ApiToken.admin.is_(True), ApiToken.revoked_at.is_(None))
        .limit(1)
    ).first()
    return Principal(owner, admin=admin is not None)


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def create_token(session: Session, name: str, *, admin: bool = False) -> str:
    """Store a new token's hash and return the token itself (the only time it exists)."""
    token = TOKEN_PREFIX + secrets.token_urlsafe(32)
    session.add(ApiToken(name=name, token_hash=hash_token(token), admin=admin, created_at=utcnow()))
    return token


def list_tokens(session: Session) -> list[ApiToken]:
    return list(session.scalars(select(ApiToken).order_by(ApiToken.id)))


def revoke_tokens(session: Session, *, name: str | None = None, token_id: int | None = None) -> int:
    stmt = update(ApiToken).where(ApiToken.revoked_at.is_(None)).values(revoked_at=utcnow())
    if token_id is not None:
        stmt = stmt.where(ApiToken.id == token_id)
    elif name is not None:
        stmt = stmt.where(ApiToken.name == name)
    else:
        raise ValueError("revoke needs a name or an id")
    return int(session.execute(stmt).rowcount)  # type: ignore[attr-defined]


def _bearer(authorization: str | None) -> str:
    if not authorization:
        raise Unauthorized("missing bearer token (Authorization: Bearer TOKEN)")
    scheme, _, token = authorization.partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        raise Unauthorized("the Authorization header must be 'Bearer TOKEN'")
    return token


# aresolve's lookup, keyed by the token's hash (AsyncReader.fetch_keyed).
_SQL_TOKEN = (
    "SELECT token_hash, name, admin FROM api_tokens"
    " WHERE token_hash = ANY(%(keys)s) AND revoked_at IS NULL"
)


def _known(principal: Principal | None) -> Principal:
    if principal is None:
        raise Unauthorized("unknown or revoked token")
    return principal


class TokenCache:
    """Resolves a bearer token to its principal, remembering answers for ``ttl_s``.

    Two bounded LRU maps: known tokens, and unknown ones (so a client sending random tokens
    costs one lookup per token, not one per request). Kept apart, so no number of unknown
    tokens can push a real one out, and each evicts only its least recently used entries."""

    def __init__(
        self,
        connect: Callable[[], AbstractContextManager[Session | Connection]],
        ttl_s: float,
        max_entries: int = 10_000,
    ) -> None:
        self._connect = connect
        self._known: TtlCache[str, Principal | None] = TtlCache(ttl_s, max_entries)
        self._unknown: TtlCache[str, Principal | None] = TtlCache(ttl_s, max_entries)

    def resolve_cached(self, authorization: str | None) -> Principal:
        """The answer without touching the database; LookupError if it would have to."""
        hit = self._fresh(hash_token(_bearer(authorization)), time.monotonic())
        if hit is None:
            raise LookupError("not cached")
        return _known(hit[1])

    def resolve(self, authorization: str | None) -> Principal:
        digest = hash_token(_bearer(authorization))
        now = time.monotonic()
        hit = self._fresh(digest, now)
        if hit is not None:
            return _known(hit[1])
        principal = self._lookup(digest)
        self._remember(digest, now, principal)
        return _known(principal)

    async def aresolve(self, authorization: str | None, reader: AsyncReader) -> Principal:
        """``resolve`` on the event loop (PostgreSQL). When an entry expires under load, the
        requests holding that token look it up together, in one statement, instead of one
        thread-pool hop and query each (a stall every ``ttl_s`` on a busy replica)."""
        digest = hash_token(_bearer(authorization))
        now = time.monotonic()
        hit = self._fresh(digest, now)
        if hit is not None:
            return _known(hit[1])
        row = await reader.fetch_keyed(_SQL_TOKEN, digest)
        principal = None
        if row is not None and hmac.compare_digest(row[0], digest):
            principal = Principal(row[1], bool(row[2]))
        self._remember(digest, now, principal)
        return _known(principal)

    def _fresh(self, digest: str, now: float) -> tuple[float, Principal | None] | None:
        """The cached answer for ``digest`` (None: an unknown token) unless absent or stale."""
        return self._known.fresh(digest, now) or self._unknown.fresh(digest, now)

    def _remember(self, digest: str, now: float, principal: Principal | None) -> None:
        self._known.pop(digest)
        self._unknown.pop(digest)
        (self._known if principal is not None else self._unknown).put(digest, now, principal)

    def _lookup(self, digest: str) -> Principal | None:
        with self._connect() as conn:
            row = conn.execute(
                select(ApiToken.name, ApiToken.admin, ApiToken.token_hash).where(
                    ApiToken.token_hash == digest, ApiToken.revoked_at.is_(None)
                )
            ).first()
        # The index finds the row; the constant-time compare is what decides.
        if row is None or not hmac.compare_digest(row.token_hash, digest):
            return None
        return Principal(row.name, bool(row.admin))
