"""Who a connection is: tokens and the namespaces each one grants.

A daemon shared by tenants needs more than one secret: a tenant's token grants its own
namespaces and nothing else, an admin token (the single ``token``/``token_file`` of older
configs, or a ``tokens`` entry with ``admin: true``) grants every namespace. Namespaces a
token does not grant are refused (``forbidden``) before any key is hashed or any state is
created for them, so a tenant can neither read, probe, delete nor crowd out another's data.

Why SHA-256 digests are compared rather than the tokens: ``hmac.compare_digest`` is
constant-time only for equal lengths, and every configured token is compared (no early
exit), so neither a token's length nor which entry matched shows in the timing.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

ADMIN_NAME = "admin"


@dataclasses.dataclass(frozen=True)
class Grant:
    """What one token allows: every namespace (``admin``) or exactly ``namespaces``."""

    name: str
    admin: bool = False
    namespaces: frozenset[str] = frozenset()

    def allows(self, ns: str) -> bool:
        return self.admin or ns in self.namespaces


OPEN = Grant("open", admin=True)  # no authentication configured: everything is allowed


@dataclasses.dataclass(frozen=True)
class TokenSpec:
    """One ``tokens`` entry as configured (the secret itself, or the file holding it)."""

    token: str | None
    token_file: str | None
    name: str
    admin: bool
    namespaces: tuple[str, ...]

    def secret(self) -> str:
        if self.token_file:
            try:
                tok = Path(self.token_file).read_text().strip()
            except OSError as e:
                raise ValueError(f"tokens[{self.name}].token_file: {e}") from None
            if not tok:
                raise ValueError(f"tokens[{self.name}].token_file: {self.token_file} is empty")
            return tok
        assert self.token is not None
        return self.token


def secret_file(v: Any, where: str) -> str | None:
    """A token file's path, ``~`` expanded (a YAML file has no shell to do it)."""
    path = nonempty_secret(v, where)
    return None if path is None else os.path.expanduser(path)


def nonempty_secret(v: Any, where: str) -> str | None:
    if v is None:
        return None
    if not isinstance(v, (str, int)) or isinstance(v, bool):
        raise ValueError(f"{where}: expected a string, got {type(v).__name__}")
    s = str(v)
    if not s.strip():
        raise ValueError(f"{where}: is empty; an empty token would let anyone in (leave it "
                         "unset to run without authentication, loopback and Unix socket only)")
    return s


def _from_string(s: str, i: int) -> dict[str, Any]:
    """``FILE:ns1,ns2`` or ``FILE:admin`` (the ``--tokens`` flag form)."""
    path, sep, rest = s.rpartition(":")
    if not sep or not path or not rest:
        raise ValueError(f"tokens[{i}]: expected FILE:NS[,NS...] or FILE:admin, got {s!r}")
    if rest == ADMIN_NAME:
        return {"token_file": path, "admin": True}
    return {"token_file": path, "namespaces": [n for n in rest.split(",") if n]}


def parse_tokens(v: Any, key: str, max_namespace: int = 64) -> tuple[TokenSpec, ...]:
    """Validate the ``tokens`` list: each entry one secret (``token`` or ``token_file``) and
    either ``admin: true`` or a non-empty ``namespaces`` list; names and secrets unique."""
    if v is None or v == "" or v == []:
        return ()
    if isinstance(v, str):  # LMC_SERVER_TOKENS: a YAML list, or one FILE:NS[,NS] entry
        import yaml

        v = yaml.safe_load(v)
        if isinstance(v, str):
            v = [v]
    if not isinstance(v, Sequence) or isinstance(v, (str, bytes)):
        raise ValueError(f"{key}: expected a list of {{token_file, namespaces}} entries, "
                         f"got {type(v).__name__}")
    out: list[TokenSpec] = []
    for i, raw in enumerate(v):
        if isinstance(raw, str):
            raw = _from_string(raw, i)
        if isinstance(raw, TokenSpec):
            out.append(raw)
            continue
        if not isinstance(raw, Mapping):
            raise ValueError(f"{key}[{i}]: expected a mapping, got {type(raw).__name__}")
        unknown = set(raw) - {"token", "token_file", "namespaces", "admin", "name"}
        if unknown:
            raise ValueError(f"{key}[{i}]: unknown key(s) {sorted(unknown)} (expected token or "
                             "token_file, namespaces or admin, and an optional name)")
        token = nonempty_secret(raw.get("token"), f"{key}[{i}].token")
        token_file = secret_file(raw.get("token_file"), f"{key}[{i}].token_file")
        if (token is None) == (token_file is None):
            raise ValueError(f"{key}[{i}]: give exactly one of token and token_file")
        admin = raw.get("admin", False)
        if not isinstance(admin, bool):
            raise ValueError(f"{key}[{i}].admin: expected true or false, got {admin!r}")
        nss = raw.get("namespaces") or []
        if isinstance(nss, str) or not isinstance(nss, Sequence):
            raise ValueError(f"{key}[{i}].namespaces: expected a list of namespace names")
        names: list[str] = []
        for ns in nss:
            if not isinstance(ns, str) or len(ns.encode()) > max_namespace:
                raise ValueError(f"{key}[{i}].namespaces: {ns!r} is not a namespace name of at "
                                 f"most {max_namespace} bytes")
            names.append(ns)
        if admin == bool(names):
            raise ValueError(f"{key}[{i}]: give either admin: true or a non-empty namespaces "
                             "list (an admin token already grants every namespace)")
        name = raw.get("name") or (ADMIN_NAME if admin else names[0])
        if not isinstance(name, str):
            raise ValueError(f"{key}[{i}].name: expected a string")
        out.append(TokenSpec(token, token_file, name, admin, tuple(names)))
    seen = [s.name for s in out]
    dup = {n for n in seen if seen.count(n) > 1}
    if dup:
        raise ValueError(f"{key}: names must be unique (give each entry a name:), repeated: "
                         f"{sorted(dup)}")
    return tuple(out)


class Authenticator:
    """Maps a presented token to its :class:`Grant`; ``None`` when nothing is configured."""

    def __init__(self, entries: Iterable[tuple[str, Grant]]) -> None:
        self._entries = [(hashlib.sha256(tok.encode()).digest(), g) for tok, g in entries]
        digests = [d for d, _ in self._entries]
        if len(set(digests)) != len(digests):
            raise ValueError("tokens: two entries have the same secret; each tenant needs "
                             "its own token")

    @classmethod
    def from_config(cls, admin_token: str | None, specs: Sequence[TokenSpec]
                    ) -> Authenticator:
        entries = [] if admin_token is None else [(admin_token, Grant(ADMIN_NAME, admin=True))]
        for s in specs:
            entries.append((s.secret(), Grant(s.name, s.admin, frozenset(s.namespaces))))
        return cls(entries)

    @property
    def required(self) -> bool:
        return bool(self._entries)

    def check(self, token: bytes) -> Grant | None:
        """The grant of ``token``; every entry is compared, in constant time each."""
        d = hashlib.sha256(token).digest()
        found: Grant | None = None
        for digest, grant in self._entries:
            if hmac.compare_digest(d, digest) and found is None:
                found = grant
        return found

    def granted_namespaces(self) -> frozenset[str]:
        """Every namespace some tenant token names (state for these is bounded by config)."""
        out: set[str] = set()
        for _, g in self._entries:
            out |= g.namespaces
        return frozenset(out)
