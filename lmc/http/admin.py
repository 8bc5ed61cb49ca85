"""The cache-control endpoints every HTTP front shares (``POST /admin/cache/<op>``): who may
call them, what a request may say, and how a refusal is answered. The reference server runs
the ops on its engine (:mod:`lmc.reference.admin`); ``lmc router`` forwards them to its
instances (:mod:`lmc.router.admin`). Threat model: docs/threats/http.md.

**Who.** Without ``--admin-token``, only loopback clients (127.0.0.0/8, ::1) are answered;
anyone else gets 403 naming the flag. With one or more ``--admin-token FILE[:NS,NS|:admin]``
every caller, loopback included, must send ``Authorization: Bearer <secret>`` (compared in
constant time; 401 otherwise), and the request's namespace (its ``namespace`` field, else the
front's own) must be one the token grants (403). A file's secret is its content, stripped,
at least 16 bytes; a token naming no namespaces (or ``admin``) grants them all.

**What.** One JSON object (within ``--max-body``), every field checked and named:
``prompt`` (text up to 1 MiB, or at most 2^20 token ids, each a uint32), ``messages`` (chat
turns: the front renders them), ``ttl`` (seconds, > 0, the engine's ``max_pin_ttl`` caps
it), ``priority`` (an integer in [-10, 10]), ``session`` (up to 256 characters),
``cache_salt`` (up to 1,024), ``namespace`` (up to 64); unknown fields are refused.
Ops: ``pin``, ``unpin``, ``priority``, ``delete``, ``clear``, ``prefetch``.

**Answers.** A rule's refusal (:mod:`lmc.storage.control`) is 400 (``ttl``, ``priority``),
403 (``namespace``) or 409 (``pin_limit``), its ``code`` in the body; one admin op runs at
a time per front (others wait, up to the request's own deadline, then 503).
"""

from __future__ import annotations

import hmac
import ipaddress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lmc.http.json_api import HttpError
from lmc.storage.control import ControlError

PATH = "/admin/cache/"
OPS = ("pin", "unpin", "priority", "delete", "clear", "prefetch")
MAX_TEXT = 1 << 20  # characters of a text prompt
MAX_TOKENS = 1 << 20
FIELDS = {"prompt", "messages", "ttl", "priority", "session", "cache_salt", "namespace",
          "lora"}
STATUS = {"ttl": 400, "priority": 400, "namespace": 403, "pin_limit": 409, "control": 400}


@dataclass(frozen=True)
class AdminGrant:
    """What a caller may steer: every namespace (``None``) or these."""

    namespaces: frozenset[str] | None

    def allows(self, ns: str) -> bool:
        return self.namespaces is None or ns in self.namespaces


@dataclass(frozen=True)
class AdminToken:
    secret: bytes
    grant: AdminGrant

    @classmethod
    def parse(cls, spec: str) -> AdminToken:
        """``FILE``, ``FILE:admin`` or ``FILE:NS1,NS2`` (``--admin-token``)."""
        path, _, scope = spec.partition(":")
        try:
            secret = Path(path).read_bytes().strip()
        except OSError as e:
            raise ValueError(f"--admin-token {path}: cannot read it ({e.strerror})") from None
        if len(secret) < 16:
            raise ValueError(f"--admin-token {path}: the secret must be at least 16 bytes")
        names = [n.strip() for n in scope.split(",") if n.strip()]
        if not names or names == ["admin"]:
            return cls(secret, AdminGrant(None))
        return cls(secret, AdminGrant(frozenset(names)))


class AdminAuth:
    """Checks a caller (module doc)."""

    def __init__(self, tokens: list[AdminToken] | None = None) -> None:
        self.tokens = list(tokens or ())

    @classmethod
    def from_specs(cls, specs: list[str] | None) -> AdminAuth:
        return cls([AdminToken.parse(s) for s in specs or ()])

    def check(self, client_host: str, authorization: str | None) -> AdminGrant:
        if not self.tokens:
            if not _loopback(client_host):
                raise HttpError(403, "the admin endpoints answer loopback clients only; "
                                     "start the server with --admin-token to open them")
            return AdminGrant(None)
        given = b""
        if authorization and authorization.startswith("Bearer "):
            given = authorization[7:].strip().encode("utf-8", "replace")
        found: AdminGrant | None = None
        for t in self.tokens:  # every token compared: the time says nothing of which
            if hmac.compare_digest(t.secret, given):
                found = t.grant
        if found is None:
            raise HttpError(401, "admin endpoints need Authorization: Bearer <token>"
                            if not given else "wrong admin token")
        return found


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host.split("%")[0]).is_loopback
    except ValueError:
        return False


@dataclass
class AdminRequest:
    op: str
    prompt: str | list[int] | None = None
    messages: list[Any] | None = None
    ttl: float | None = None
    priority: int | None = None
    session: str | None = None
    cache_salt: str | None = None
    lora: str | None = None
    namespace: str | None = None


def op_of(path: str) -> str:
    """The op a ``POST`` path names (404 for anything else)."""
    op = path[len(PATH):] if path.startswith(PATH) else ""
    if op not in OPS:
        raise HttpError(404, f"no such path {path[:200]} (POST {PATH}<{'|'.join(OPS)}>)")
    return op


def _str(body: dict[str, Any], name: str, limit: int) -> str | None:
    v = body.get(name)
    if v is None:
        return None
    if not isinstance(v, str) or len(v) > limit:
        raise HttpError(400, f"{name} must be a string of at most {limit} characters")
    return v


def parse_admin(op: str, body: Any) -> AdminRequest:
    """``body`` checked field by field for ``op`` (a 400 naming the first wrong one)."""
    if not isinstance(body, dict):
        raise HttpError(400, "the body must be a JSON object")
    extra = sorted(set(body) - FIELDS)
    if extra:
        raise HttpError(400, f"unknown field {extra[0][:64]!r} (fields: "
                        f"{', '.join(sorted(FIELDS))})")
    req = AdminRequest(op, session=_str(body, "session", 256),
                       cache_salt=_str(body, "cache_salt", 1024), lora=_str(body, "lora", 256),
                       namespace=_str(body, "namespace", 64))
    prompt, messages = body.get("prompt"), body.get("messages")
    if prompt is not None:
        if isinstance(prompt, str):
            if len(prompt) > MAX_TEXT:
                raise HttpError(400, f"prompt: text of at most {MAX_TEXT} characters")
        elif not (isinstance(prompt, list) and len(prompt) <= MAX_TOKENS and all(
                isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 1 << 32
                for t in prompt)):
            raise HttpError(400, f"prompt must be text or a list of at most {MAX_TOKENS} "
                            "token ids (uint32)")
        req.prompt = prompt
    if messages is not None:
        if not isinstance(messages, list) or not 0 < len(messages) <= 4096:
            raise HttpError(400, "messages must be a list of 1 to 4096 turns")
        req.messages = messages
    if prompt is not None and messages is not None:
        raise HttpError(400, "give prompt or messages, not both")
    needs_prompt = op in ("pin", "priority", "delete", "prefetch") or (
        op == "unpin" and req.session is None)
    if needs_prompt and prompt is None and messages is None:
        raise HttpError(400, f"{op} needs a prompt (or messages)"
                        + (" or a session" if op == "unpin" else ""))
    ttl = body.get("ttl")
    if op == "pin":
        if isinstance(ttl, bool) or not isinstance(ttl, (int, float)):
            raise HttpError(400, "pin needs ttl, a number of seconds")
        req.ttl = float(ttl)
    elif ttl is not None:
        raise HttpError(400, f"ttl is for pin, not {op}")
    p = body.get("priority")
    if p is not None or op == "priority":
        if isinstance(p, bool) or not isinstance(p, int):
            raise HttpError(400, "priority must be an integer")
        req.priority = p
    return req


def refusal(e: ControlError) -> tuple[int, dict[str, Any]]:
    """The status and body a rule's refusal is answered with."""
    status = STATUS.get(e.code, 400)
    return status, {"error": {"message": str(e), "type": "invalid_request_error",
                              "code": status, "rule": e.code}}
