"""The reference server's cache-control endpoints (``POST /admin/cache/<op>``): who may call
them and what a request may say are :mod:`lmc.http.admin`'s; this module turns a checked
request into calls on the engine's ``CacheEngine`` (its connector's ``engine``): the
prompt is tokenized as a completion's would be (text, token ids, or chat ``messages``
rendered by the checkpoint's template), then pinned, prioritised, deleted, cleared or
prefetched. Calls run between engine steps (the loop's lock), one admin op at a time.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from lmc.http.admin import AdminGrant, AdminRequest
from lmc.http.json_api import HttpError
from lmc.token_database import request_root, request_tag

log = logging.getLogger(__name__)


class EngineAdmin:
    """One server's admin ops (module doc); ``server`` is its :class:`Server`."""

    def __init__(self, server: Any) -> None:
        self.server = server
        self._busy = threading.Lock()

    def _engine(self) -> Any:
        engine = getattr(getattr(self.server.llm, "kv_connector", None), "engine", None)
        if engine is None:
            raise HttpError(409, "this server has no lmc cache to steer (started without "
                            "--lmc-config, or no KV cache registered yet)")
        return engine

    def _tokens(self, req: AdminRequest) -> list[int] | None:
        llm = self.server.llm
        try:
            if req.messages is not None:
                tokens = llm.encode_chat(req.messages)
            elif req.prompt is not None:
                tokens = llm.encode(req.prompt)
            else:
                return None
        except ValueError as e:  # no tokenizer for text, a bad chat turn, ids out of range
            raise HttpError(400, str(e)) from None
        if len(tokens) > llm.max_model_len:
            raise HttpError(400, f"prompt of {len(tokens)} tokens exceeds max_model_len="
                            f"{llm.max_model_len}")
        return list(tokens)

    def run(self, req: AdminRequest, grant: AdminGrant, timeout: float) -> dict[str, Any]:
        """The op's answer; ``HttpError`` or a rule's ``ControlError`` for a refusal."""
        engine = self._engine()
        ns = req.namespace if req.namespace is not None else engine.namespace
        if not grant.allows(ns):
            raise HttpError(403, f"this token does not grant namespace {ns[:64]!r}")
        tokens = self._tokens(req)
        if not self._busy.acquire(timeout=timeout):
            raise HttpError(503, "another admin operation is still running; try again")
        try:
            out = self.server.loop.call(lambda: self._call(engine, req, ns, tokens))
        finally:
            self._busy.release()
        log.info("admin %s in namespace %s: %s", req.op, ns, out)
        return out

    @staticmethod
    def _call(engine: Any, req: AdminRequest, ns: str, tokens: list[int] | None
              ) -> dict[str, Any]:
        salt = {"salt": req.cache_salt, "lora": req.lora, "namespace": ns}
        if req.op == "pin":
            n = engine.pin(tokens, req.ttl, priority=req.priority, session=req.session, **salt)
            return {"pinned_tokens": n, "prompt_tokens": len(tokens or ())}
        if req.op == "unpin":
            engine.control.check_namespace(ns)
            return {"unpinned_chunks": engine.unpin(tokens, session=req.session,
                                                    salt=req.cache_salt, lora=req.lora)}
        if req.op == "priority":
            return {"chunks": engine.set_priority(tokens, req.priority, **salt)}
        if req.op == "delete":
            return {"deleted": engine.delete(tokens, **salt)}
        if req.op == "clear":
            return {"cleared": engine.clear(ns)}
        # prefetch: into L1 in the background, from the chain of the request's own root
        engine.control.check_namespace(ns)
        tag = request_tag(req.lora, req.cache_salt)
        root = None if tag is None else request_root(engine.db.namespace, tag)
        engine.prefetch(tokens, 0, root=root)
        return {"queued": True, "prompt_tokens": len(tokens or ())}
