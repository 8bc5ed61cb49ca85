"""``lmc router``'s cache-control endpoints (``POST /admin/cache/<op>``) and its prefetches.

A request is checked as every front checks it (:mod:`lmc.http.admin`: loopback-only unless
``--admin-token``, every field named), then forwarded: ``pin`` to the instance the policy
would send the prompt to (its cache is the one the next request will use), every other op
to every healthy instance (each holds its own tiers). A token scoped to namespaces must name
one it grants (``namespace``), which each instance checks against its own. Instances are
called with ``--upstream-admin-token``'s secret as their bearer token when given (else none:
they then answer the router only if it reaches them on loopback). Each instance's answer is
read within 64 KiB and ``--upstream-timeout``; the reply lists them all by URL.

**Router-driven prefetch** (:func:`prefetch_if_lower`): when a completion is routed to an
instance whose events say it holds more of the prompt in a lower tier (or a shared store it
reads) than in memory, the router asks that instance to prefetch the prompt into L1
(``/admin/cache/prefetch``, answered at once: the instance reads in the background) before
forwarding, so the load overlaps the request's queueing. A failed or refused prefetch is
counted and never delays the request past ``PREFETCH_TIMEOUT``.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from lmc.http.admin import PATH, AdminAuth, AdminGrant, op_of, parse_admin
from lmc.http.json_api import HttpError
from lmc.router.relay import UPSTREAM_ERRORS, read_bounded, what

log = logging.getLogger(__name__)
ANSWER_LIMIT = 64 << 10
PREFETCH_TIMEOUT = 1.0  # seconds a prefetch request may delay the request it is for


class RouterAdmin:
    """The router's admin side: who may call, the secret it calls instances with."""

    def __init__(self, auth: AdminAuth | None = None, upstream_secret: str | None = None
                 ) -> None:
        self.auth = auth or AdminAuth()
        self.headers = {"Authorization": f"Bearer {upstream_secret}"} \
            if upstream_secret else {}
        self.prefetches = {"sent": 0, "failed": 0}

    def handle(self, handler: Any, router: Any) -> None:
        """Answer ``handler``'s ``POST /admin/cache/<op>``."""
        try:
            op = op_of(handler.path)
            grant = self.auth.check(handler.client_address[0],
                                    handler.headers.get("Authorization"))
            body = handler.read_json()
            req = parse_admin(op, body)
            self._scope(grant, req.namespace)
        except HttpError as e:
            handler.answer_error(e.status, str(e))
            return
        data = json.dumps(body).encode()
        if op == "pin":
            from lmc.router.dispatch import cache_salt, prompt_tokens
            pick = router.fleet.pick(prompt_tokens(body, router.tokenizer), cache_salt(body))
            router.fleet.done(pick.instance)
            targets = [pick.instance]
        else:
            targets = [i for i in router.instances if i.healthy]
        out = {i.url: self._call(i, op, data) for i in targets}
        log.info("admin %s forwarded to %s", op,
                 ", ".join(f"{u} ({a['status']})" for u, a in out.items()) or "no instance")
        handler.answer_json(200 if targets else 503, {"op": op, "instances": out})

    @staticmethod
    def _scope(grant: AdminGrant, ns: str | None) -> None:
        if grant.namespaces is None:
            return
        if ns is None:
            raise HttpError(403, "this token is scoped to namespaces: name one in "
                            "'namespace'")
        if not grant.allows(ns):
            raise HttpError(403, f"this token does not grant namespace {ns[:64]!r}")

    def _call(self, inst: Any, op: str, data: bytes, timeout: float | None = None
              ) -> dict[str, Any]:
        """One instance's answer to ``op``: its status and JSON (or why there is none)."""
        try:
            conn, resp = inst.upstream.post(PATH + op, data, self.headers, timeout)
        except UPSTREAM_ERRORS as e:
            return {"status": 502, "error": what(e)}
        try:
            raw = read_bounded(resp, ANSWER_LIMIT, inst.url)
            answer = json.loads(raw) if raw else {}
        except (HttpError, ValueError, *UPSTREAM_ERRORS) as e:
            return {"status": 502, "error": what(e)}
        finally:
            conn.close()
        return {"status": resp.status, **(answer if isinstance(answer, dict) else {})}

    def prefetch_if_lower(self, inst: Any, match: Any, body: dict[str, Any]) -> bool:
        """Ask ``inst`` to prefetch the prompt when ``match`` (its events' view) says part
        of the cached prefix lies only below memory; whether it was asked."""
        if match is None or match.storage <= match.cpu:
            return False
        fields = {k: body[k] for k in ("prompt", "cache_salt") if k in body}
        self.prefetches["sent"] += 1
        got = self._call(inst, "prefetch", json.dumps(fields).encode(), PREFETCH_TIMEOUT)
        if got.get("status") != 200:
            self.prefetches["failed"] += 1
            log.debug("prefetch on %s failed: %s", inst.url, got)
        return True
