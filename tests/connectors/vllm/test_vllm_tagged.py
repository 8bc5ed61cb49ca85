"""LoRA and salted vLLM requests are cached, each apart (no vLLM needed): vLLM's scheduler half
(:class:`SchedulerSide`, on the fake vLLM requests of ``test_vllm_parts``) asks a real
CacheEngine over the real lookup socket (and in-process), plans loads and saves, and the
worker half executes them; every lookup, load and save of a request uses its own key root.

The attacker's view: a user who knows (or guesses) another's prompt and times its first token
must see a miss unless it sends the same salt and adapter -- whatever salt it crafts."""

from __future__ import annotations

import socket
import struct
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from lmc import CacheConfig, CacheEngine
from lmc.connectors.core.lookup_service import (
    MAX_TOKENS,
    TAGGED_REQ_MAGIC,
    LookupClient,
    LookupServer,
    encode_request,
    engine_lookup,
)
from lmc.connectors.core.metadata import ConnectorMetadata, LoadSpec
from lmc.connectors.core.scheduler import ConnectorConfig
from lmc.connectors.core.worker import WorkerConnector, slot_mapping
from lmc.connectors.vllm.lookup import socket_paths
from lmc.connectors.vllm.scheduler import SchedulerSide
from lmc.storage.lookup import LookupResult
from lmc.token_database import request_root, request_tag
from tests import lookup_sockets
from tests.connectors.core.test_worker_side import step
from tests.connectors.vllm.test_vllm_parts import FakeRequest, NewReq, Output
from tests.kvutil import assert_bits_equal, make_caches, random_tokens, spec_for, token_kv

CS, BS, LAYERS = 8, 4, 3
N = 5 * CS + 3  # 5 chunks and a partial tail
sock_dir = lookup_sockets.sock_dir  # the fixture


@dataclass
class LoRA:
    """vLLM's ``LoRARequest`` fields the connector reads (name) and the ones it leaves."""

    lora_name: str
    lora_int_id: int = 1
    lora_path: str = "/adapters/x"


class Instance:
    """One vLLM engine's two halves over one CacheEngine: a saving worker on caches whose
    contents stand for the forward's KV, a loading worker on zeroed caches."""

    def __init__(self, sock_dir: Any, use_local: bool) -> None:
        self.src = make_caches("vllm_flash", layers=LAYERS, blocks=64, block_size=BS, seed=3)
        self.dst = make_caches("vllm_flash", layers=LAYERS, blocks=64, block_size=BS,
                               zeros=True)
        self.spec = spec_for("vllm_flash", self.src)
        self.engine = CacheEngine(CacheConfig(chunk_size=CS, local_cpu_size="8MiB"),
                                  self.spec, "m")
        (path,) = socket_paths(sock_dir, "tagged", 0, 1)
        self.server = LookupServer(path, engine_lookup(lambda: self.engine))
        self.client = LookupClient([path], 5.0, use_local=use_local)
        self.sched = SchedulerSide(ConnectorConfig(chunk_size=CS), self.client)
        self.saver = WorkerConnector(self.engine, self.src, BS)
        self.loader = WorkerConnector(self.engine, self.dst, BS)
        self.n = 0

    def close(self) -> None:
        self.sched.close()
        self.server.close()
        self.saver.close()
        self.loader.close()
        self.engine.close()

    def serve(self, tokens: list[int], save: bool = False, **fields: Any
              ) -> tuple[int, ConnectorMetadata, set[int]]:
        """Admit a request, run its prefill step on the saver (``save``) or the loader,
        finish it; (tokens lmc supplied, the step's metadata, blocks whose load failed)."""
        self.n += 1
        req = FakeRequest(f"r{self.n}", list(tokens), **fields)
        hit, is_async = self.sched.get_num_new_matched_tokens(req, 0)
        assert not is_async
        self.sched.update_state_after_alloc(req, hit)
        table = list(range(0, -(-len(tokens) // BS)))
        meta = self.sched.build_meta(Output([NewReq(req.request_id, (table,), hit)],
                                            num_scheduled_tokens={req.request_id:
                                                                  len(tokens) - hit}))
        w = self.saver if save else self.loader
        errors = step(w, meta)
        self.sched.request_finished(req)
        return hit, meta, errors

    def kv(self, caches: Any, n: int) -> torch.Tensor:
        slots = torch.from_numpy(slot_mapping(tuple(range(64)), BS, n, 0, n))
        return token_kv(self.spec, caches, slots)


@pytest.fixture(params=["socket", "in-process"])
def inst(request, sock_dir):
    i = Instance(sock_dir, use_local=request.param == "in-process")
    yield i
    i.close()


PROMPT = random_tokens(N, seed=11)


def test_a_salted_request_is_saved_and_hit_by_the_same_salt_bit_exact(inst):
    hit, meta, _ = inst.serve(PROMPT, save=True, cache_salt="tenant-a")
    assert hit == 0
    (save,) = meta.saves
    assert save.key_tag == request_tag(None, "tenant-a")  # the plan carries the request's tag
    assert inst.saver.stats.saved_tokens == N
    hit, meta, errors = inst.serve(PROMPT, cache_salt="tenant-a")
    assert hit == N - 1 and not errors  # the last token is vLLM's
    (load,) = meta.loads
    assert load.key_tag == request_tag(None, "tenant-a")
    assert_bits_equal(inst.kv(inst.dst, N)[:, :, :N - 1], inst.kv(inst.src, N)[:, :, :N - 1],
                      "salted load")
    assert inst.sched.stats()["lookup.lookups"] >= 2


@pytest.mark.parametrize(("stored", "asked"), [
    ({"cache_salt": "tenant-a"}, {"cache_salt": "tenant-b"}),
    ({"cache_salt": "tenant-a"}, {}),                             # salt A -> no salt
    ({}, {"cache_salt": "tenant-a"}),                             # no salt -> salt A
    ({"cache_salt": "tenant-a"}, {"cache_salt": "tenant-`"}),     # one byte off
    ({"cache_salt": "tenant-a"}, {"cache_salt": "tenant-a\0"}),   # a NUL appended
    ({"cache_salt": ""}, {}),                                     # empty salt vs none
    ({}, {"cache_salt": ""}),
    ({"lora_request": LoRA("x")}, {}),                            # LoRA X -> base model
    ({}, {"lora_request": LoRA("x")}),                            # base -> LoRA X
    ({"lora_request": LoRA("x")}, {"lora_request": LoRA("y")}),   # LoRA X -> LoRA Y
    ({"lora_request": LoRA("x")}, {"lora_request": LoRA("x"), "cache_salt": "s"}),
    ({"lora_request": LoRA("x"), "cache_salt": "s"}, {"cache_salt": "s"}),
])
def test_another_salt_or_adapter_never_hits(inst, stored, asked):
    inst.serve(PROMPT, save=True, **stored)
    assert inst.saver.stats.saved_tokens == N
    hit, meta, errors = inst.serve(PROMPT, **asked)
    assert hit == 0 and not meta.loads and not errors
    assert not inst.kv(inst.dst, N).any(), "nothing was written"
    # ... and the owner still hits (the other request's own save did not replace it)
    hit, _, _ = inst.serve(PROMPT, **stored)
    assert hit == N - 1


def test_same_adapter_hits_whatever_its_path(inst):
    """LoRA identity is the name: an instance that loads the adapter from elsewhere shares
    (the operator's promise: one name, one set of weights; see request_tag)."""
    inst.serve(PROMPT, save=True, lora_request=LoRA("x", 1, "/a/x"))
    hit, _, errors = inst.serve(PROMPT, lora_request=LoRA("x", 7, "/mnt/other/x"))
    assert hit == N - 1 and not errors


def test_crafted_salts_are_hashed_never_crash(inst):
    """Separators, NULs, lone surrogates and a megabyte of unicode: each keys a chain of its
    own; none reaches the others' KV."""
    salts = ["a|b\n:;=", "\0", "\0\0", "\ud800", "ñ€𝄞" * 300_000]
    for s in salts:
        inst.serve(PROMPT, save=True, cache_salt=s)
    for s in salts:
        hit, _, _ = inst.serve(PROMPT, cache_salt=s)
        assert hit == N - 1, repr(s[:10])
    for s in ("a|b", "\0\0\0", "ñ€𝄞" * 299_999, ""):
        hit, _, _ = inst.serve(PROMPT, cache_salt=s)
        assert hit == 0, repr(s[:10])


@pytest.mark.parametrize(("fields", "why"), [
    ({"cache_salt": b"bytes"}, "cache_salt must be a string or None, got bytes"),
    ({"lora_request": object()}, "a LoRA request without a name"),
    ({"lora_request": LoRA("")}, "a LoRA request without a name"),
])
def test_fields_lmc_cannot_key_by_leave_the_request_to_the_engine(inst, fields, why, caplog):
    inst.serve(PROMPT, save=True)  # the plain chain holds the prompt
    with caplog.at_level("WARNING"):
        hit, meta, errors = inst.serve(PROMPT, **fields)
    assert hit == 0 and not meta.loads and not meta.saves and not errors
    assert why in caplog.text
    assert inst.sched.stats()["scheduler.untagged_refusals"] == 1


def test_a_load_spec_with_another_tag_is_a_load_error_never_other_kv(inst):
    """The worker keys a load by its spec's tag: a spec that names another tag than the
    stored one (a scheduler bug, a forged plan) finds nothing and reports the blocks."""
    inst.serve(PROMPT, save=True, cache_salt="tenant-a")
    table = tuple(range(-(-N // BS)))
    bad = LoadSpec("evil", tuple(PROMPT), table, 0, N - 1, 0, request_tag(None, "tenant-b"))
    errors = step(inst.loader, ConnectorMetadata(99, loads=[bad]))
    assert errors == set(table)
    assert not inst.kv(inst.dst, N).any()


def test_salted_keys_are_not_the_plain_chains_in_the_store(inst):
    inst.serve(PROMPT, save=True, cache_salt="tenant-a")
    plain = inst.engine.db.keys(PROMPT)
    salted = inst.engine.db.keys(PROMPT, root=request_root(inst.engine.db.namespace,
                                                            request_tag(None, "tenant-a")))
    assert not any(inst.engine.storage.l1_contains(plain))
    assert all(inst.engine.storage.l1_contains(salted))


def test_a_tagged_lookup_on_the_wire_carries_only_a_digest():
    salt = "my-secret-salt-value"
    frame = encode_request([1, 2, 3], request_tag(None, salt))
    assert salt.encode() not in frame and frame[:4] == b"LMT2"
    with pytest.raises(ValueError, match="key tag must be 16 bytes"):
        encode_request([1, 2, 3], b"short")


def test_malformed_tagged_lookups_close_the_connection_and_the_server_lives(sock_dir):
    """A tagged request claiming too many tokens is refused before its tag is read; one whose
    sender stops inside its tag is dropped; a plain lookup function (no tag parameter) answers a
    tagged lookup with a miss, never a dead server; the server then still answers."""
    (path,) = socket_paths(sock_dir, "malformed", 0, 1)
    server = LookupServer(path, lambda tokens: LookupResult(len(tokens), CS))
    try:
        head = struct.pack("<4sI", TAGGED_REQ_MAGIC, MAX_TOKENS + 1)
        lookup_sockets.send_and_expect_close(path, head + b"t" * 16)
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:  # ends inside the tag
            s.connect(path)
            s.sendall(struct.pack("<4sI", TAGGED_REQ_MAGIC, 2) + b"short")
            s.shutdown(socket.SHUT_WR)
            s.settimeout(2)
            assert s.recv(16) == b""
        client = LookupClient([path], 5.0, use_local=False)
        tag = request_tag(None, "s")
        assert client.lookup([1] * 20, tag).tokens == 0  # cannot key by a tag: a miss
        assert client.lookup([1] * 20).tokens == 20      # alive, plain lookups unchanged
        # the oversized count; a sender that hangs up and a tag it cannot key by are not
        assert server.errors == 1
        client.close()
    finally:
        server.close()
