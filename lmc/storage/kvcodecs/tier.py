"""The ``codec`` wrapper: a tier that holds its chunks coded (``tiers:`` entry ``codec:``).

In config a codec is a key of the tier it applies to::

    tiers:
      - memory                                     # L1 stays exact
      - {backend: disk, path: /var/cache/lmc, codec: fp8-e4m3}
      - {backend: "mooncake://m:50051", codec: int4-kivi+zstd}

which builds ``{wrap: codec, codec: ..., tier: <the entry>}``. ``put`` encodes each chunk
(:class:`lmc.storage.kvcodecs.stage.CodecStage`) into a pool object of ``[1, 1, 1, bytes]``
uint8 -- the header, then the body -- and hands those to the tier below under keys of the
stage's namespace; that tier frames them as any value (checksum, keyed tag: every byte
covered). ``get`` reads them back, checks the header (this stage's ident, lengths against the
shape, the shape against the engine's geometry) and decodes into a pool object of the
chunk's shape. A value failing any check is a corrupt value: released, counted, deleted
below, a miss. Reads are whole chunks (``get_layers`` answers ``None``).

The gate. A lossy stage stores a model's KV only once :meth:`CodecTier.open_gate` found a
passing ``lmc quality`` verdict for (model identity, KV dtype, codec and its parameters)
(:mod:`lmc.storage.kvcodecs.gate`); the engine calls it when it binds. Until then, or when
refused, the tier is its inner tier unchanged: exact values under the engine's own keys (one
line says why). ``gate: off`` uses the codec without a verdict (benchmarks, or an operator who
measured it elsewhere: logged). A lossless-only stage needs no verdict.

What the tier holds shows in :meth:`stats` (``codec``, ``codec_active``, ``codec_gate``,
``codec_raw_bytes_write`` / ``codec_stored_bytes_write`` and the same for reads) and in Prometheus
(``lmc_codec_bytes{tier, op, form}``).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from lmc.metrics import codec_bytes
from lmc.settings import ConfigError, parse_choice, parse_int, parse_opt_path
from lmc.storage.integrity import Geometry, Integrity
from lmc.storage.kvcodecs import gate as gates
from lmc.storage.kvcodecs.stage import HEADER, CodecStage, parse_stage
from lmc.storage.remote import Rejects
from lmc.storage.serde import CorruptValue, encodable
from lmc.storage.tier import (
    BackendOption,
    Key,
    StorageBackend,
    TierCapabilities,
    register_backend,
)
from lmc.storage.wrappers import WrapperTier

if TYPE_CHECKING:
    from lmc.config import CacheConfig
    from lmc.memory.pool import MemoryObj
    from lmc.storage.layered_read import LayeredRead

log = logging.getLogger(__name__)
GATES = ("verdict", "off")


def _parse_codec(value: Any, key: str) -> Any:
    try:
        parse_stage(value, key)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    return value


def _parse_head_size(value: Any, key: str) -> int | None:
    return None if value is None or value == "" else parse_int(value, key, minimum=1)


@dataclasses.dataclass(frozen=True)
class CodedGeometry(Geometry):
    """What the tier below holds for an engine of geometry ``Geometry``: coded values of
    ``[1, 1, 1, n]`` uint8 with ``HEADER < n <= max_value`` (checked before it allocates)."""

    max_value: int = 0

    @property
    def max_bytes(self) -> int:
        return self.max_value

    def check(self, shape: Sequence[int], dtype: torch.dtype) -> None:
        shape = tuple(shape)
        if (dtype != torch.uint8 or len(shape) != 4 or shape[:3] != (1, 1, 1)
                or not HEADER < shape[3] <= self.max_value):
            raise CorruptValue(f"value holds {list(shape)} {dtype}, this tier's coded chunks "
                               f"are [1, 1, 1, <= {self.max_value}] uint8")


@register_backend("codec")
class CodecTier(WrapperTier):
    """Codes chunks on their way to the tier it wraps (module docstring)."""

    OPTIONS = {
        **WrapperTier.OPTIONS,
        "codec": BackendOption("fp8-e4m3", _parse_codec,
                               "the codec stage: fp8-e4m3, int8, int4-kivi, none; '+zstd' or "
                               "'+lz4' adds a lossless stage; or {name:, group:, lossless:, "
                               "level:}"),
        "head_size": BackendOption(None, _parse_head_size,
                                   "the scales' granularity along a token's width (default: "
                                   "the engine's head size)"),
        "gate": BackendOption("verdict", lambda v, k: parse_choice(v, k, GATES),
                              "verdict: a lossy codec only with a passing quality verdict for "
                              "the model; off: always"),
        "verdicts": BackendOption(None, parse_opt_path,
                                  "the folder of lmc quality's verdicts (default: lmc_quality/ "
                                  "next to the model's checkpoint, when the engine knows it)"),
    }

    def __init__(self, spec: str = "codec", *, config: CacheConfig, pool: Any,
                 inner: StorageBackend | None = None, tier: str | None = None,
                 codec: Any = "fp8-e4m3", head_size: int | None = None,
                 gate: str = "verdict", verdicts: str | None = None, **_: Any) -> None:
        super().__init__(spec, config=config, pool=pool, inner=inner, tier=tier)
        caps = self.capabilities
        self.capabilities = TierCapabilities(False, caps.existence_without_reading,
                                             caps.durable)
        self.codec_spec = codec
        self.configured_head_size = head_size
        self.stage = parse_stage(codec, "codec", head_size)
        self.gate = parse_choice(gate, "gate", GATES)
        self.verdicts = verdicts
        self.integrity = Integrity.from_config(config)
        self.active: CodecStage | None = (
            self.stage if self.gate == "off" or not self.stage.lossy else None)
        """The stage in use; ``None``: the gate is closed and values pass through exact."""
        self.gate_reason = "gate off" if self.gate == "off" else "no model bound yet"
        self.engine_geometry: Geometry | None = None
        self._lock = threading.Lock()
        self.counts: dict[str, float] = {}
        self._bytes = {(op, form): codec_bytes(self.name, op, form)
                       for op in ("write", "read") for form in ("raw", "stored")}
        self._rejects: Rejects[Key] = Rejects(f"codec tier {self.name}")
        self.inner.on_evicted = self._inner_evicted
        if self.gate == "off" and self.stage.lossy:
            log.warning("tier %s: codec %s used without a quality verdict (gate: off)",
                        self.name, self.stage.ident)

    # ------------------------------------------------------------ engine hooks
    def __setattr__(self, name: str, value: Any) -> None:
        if name == "expected_geometry":
            self._set_geometry(value)
        elif name == "on_evicted":
            object.__setattr__(self, "_engine_on_evicted", value)
        else:
            super().__setattr__(name, value)

    def _set_geometry(self, geometry: Geometry | None) -> None:
        """The engine's chunk geometry: the codec's head size comes from it (unless
        configured), and the tier below checks coded values against its coded form."""
        object.__setattr__(self, "engine_geometry", geometry)
        if geometry is not None and self.configured_head_size is None:
            stage = parse_stage(self.codec_spec, "codec", geometry.head_size)
            object.__setattr__(self, "stage", stage)
            if self.active is not None:
                object.__setattr__(self, "active", stage)
        self.inner.expected_geometry = self._inner_geometry()

    def _inner_geometry(self) -> Geometry | None:
        g = self.engine_geometry
        if g is None or self.active is None:
            return g
        shape = (g.layers, g.planes, g.max_tokens, g.width)
        return CodedGeometry(1, 1, 1, torch.uint8, 1, 1, max_value=self.active.max_stored(
            shape, g.dtype))

    def open_gate(self, model_id: str, dtype: torch.dtype, model_dir: Any = None) -> bool:
        """Decide, for this model's KV, whether the lossy stage is used (one line either
        way: INFO, or WARNING when a verdict was there but unusable); returns whether."""
        if not self.stage.lossy or self.gate == "off":
            return True
        from lmc.storage.kvcodecs.feature import canonical_setting

        setting = canonical_setting(self.codec_spec, self.configured_head_size)
        store = gates.verdict_store(self.verdicts, model_dir, self.integrity)
        decision = gates.decide_codec(setting, model_id, str(dtype).removeprefix("torch."),
                                      store)
        object.__setattr__(self, "active", self.stage if decision.on else None)
        object.__setattr__(self, "gate_reason", decision.why)
        self.inner.expected_geometry = self._inner_geometry()
        (log.warning if decision.warn else log.info)(
            "tier %s: codec %s %s: %s", self.name, setting,
            "on" if decision.on else "off (values stored exact)", decision.why)
        return decision.on

    def _inner_evicted(self, keys: list[Key]) -> None:
        hook = self.__dict__.get("_engine_on_evicted")
        if hook is not None:
            stage = self.active
            hook([stage.namespace(k) for k in keys] if stage is not None else keys)

    # ------------------------------------------------------------------ calls
    def _keys(self, keys: Sequence[Key]) -> list[Key]:
        stage = self.active
        return list(keys) if stage is None else [stage.namespace(k) for k in keys]

    def contains(self, keys: Sequence[Key]) -> list[bool]:
        return self.inner.contains(self._keys(keys))

    def prefix_hits(self, keys: Sequence[Key]) -> int:
        return self.inner.prefix_hits(self._keys(keys))

    def delete(self, keys: Sequence[Key]) -> int:
        return self.inner.delete(self._keys(keys))

    def get_layers(self, keys: Sequence[Key]) -> LayeredRead | None:
        return None if self.active is not None else self.inner.get_layers(keys)

    def set_priority(self, keys: Sequence[Key], priority: int) -> int:
        return self.inner.set_priority(self._keys(keys), priority)

    def clear_namespace(self, prefix: bytes = b"") -> list[Key] | None:
        """The tier below clears the coded keys starting with ``prefix``'s image; the keys it
        lists come back under the engine's names (the listeners' removal events)."""
        stage = self.active
        if stage is None:
            return self.inner.clear_namespace(prefix)
        got = self.inner.clear_namespace(stage.namespace_prefix(prefix))
        return None if got is None else [stage.namespace(k) for k in got]

    def put(self, keys: Sequence[Key], objs: Sequence[MemoryObj]) -> int:
        if len(keys) != len(objs):
            raise ValueError(f"put of {len(keys)} keys with {len(objs)} objects")
        stage = self.active
        if stage is None:
            return self.inner.put(keys, objs)
        coded: list[MemoryObj] = []
        ckeys: list[Key] = []
        try:
            t0 = time.perf_counter()
            raw = stored = 0
            for k, o in zip(keys, objs):
                if not encodable(o):
                    self._count(skipped=1)
                    continue
                c = self._encode(stage, o)
                if c is not None:
                    coded.append(c)
                    ckeys.append(stage.namespace(k))
                    raw += o.nbytes
                    stored += c.nbytes
            self._count(encode_seconds=time.perf_counter() - t0)
            n = self.inner.put(ckeys, coded) if coded else 0
            if n:
                self._moved("write", raw, stored)
            return n
        finally:
            for c in coded:
                c.release()

    def _encode(self, stage: CodecStage, obj: MemoryObj) -> MemoryObj | None:
        """``obj`` coded into a pool object (``None``: no room in the pool, counted)."""
        x = obj.tensor
        coded = stage.encode(x)
        header = stage.header(coded, tuple(x.shape), x.dtype)
        out = self.pool.allocate((1, 1, 1, HEADER + coded.stored_len), torch.uint8, 1)
        if out is None:
            self._count(alloc_failures=1)
            return None
        raw = out.tensor.reshape(-1)
        raw[:HEADER].copy_(torch.frombuffer(bytearray(header), dtype=torch.uint8))
        body = coded.body
        raw[HEADER:].copy_(torch.frombuffer(bytearray(body), dtype=torch.uint8)
                           if isinstance(body, bytes) else body)
        if coded.method == 0 and stage.encodes(x.dtype):
            self._count(exact_chunks=1)
        return out

    def get(self, keys: Sequence[Key]) -> list[MemoryObj | None]:
        stage = self.active
        if stage is None:
            return self.inner.get(keys)
        ckeys = [stage.namespace(k) for k in keys]
        got = self.inner.get(ckeys)
        out: list[MemoryObj | None] = []
        t0 = time.perf_counter()
        raw = stored = 0
        for ck, o in zip(ckeys, got):
            if o is None:
                out.append(None)
                continue
            try:
                obj = self._decode(stage, ck, o)
            finally:
                o.release()
            out.append(obj)
            if obj is not None:
                raw += obj.nbytes
                stored += o.nbytes
        self._count(decode_seconds=time.perf_counter() - t0)
        self._moved("read", raw, stored)
        bad = self._rejects.delete_with(self.inner.delete)
        if bad:
            self._count(corrupt=bad)
            self.metrics.checksum_failure(bad)
        return out

    def _decode(self, stage: CodecStage, ckey: Key, o: MemoryObj) -> MemoryObj | None:
        """The chunk coded in ``o``; ``None`` (and the value rejected) when it is bad, or
        when the pool has no room (counted)."""
        view = o.byte_view()
        try:
            method, lossless, dtype, shape, blen = stage.read_header(view, o.nbytes)
            if self.engine_geometry is not None:
                self.engine_geometry.check(shape, dtype)
        except CorruptValue as e:
            self._rejects.reject(ckey, e)
            return None
        obj = self.pool.allocate(shape, dtype, shape[2])
        if obj is None:
            self._count(alloc_failures=1)
            return None
        try:
            body = view[HEADER:] if lossless else o.tensor.reshape(-1)[HEADER:]
            stage.decode(method, lossless, body, blen, obj.tensor)
        except CorruptValue as e:
            obj.release()
            self._rejects.reject(ckey, e)
            return None
        except BaseException:
            obj.release()
            raise
        return obj

    # ------------------------------------------------------------------ stats
    def _count(self, **kv: float) -> None:
        with self._lock:
            for k, v in kv.items():
                self.counts[k] = self.counts.get(k, 0) + v

    def _moved(self, op: str, raw: int, stored: int) -> None:
        if raw or stored:
            self._bytes[(op, "raw")].inc(raw)
            self._bytes[(op, "stored")].inc(stored)
            self._count(**{f"raw_bytes_{op}": raw, f"stored_bytes_{op}": stored})

    def stats(self) -> dict[str, Any]:
        with self._lock:
            mine = {f"codec_{k}": v for k, v in self.counts.items()}
        return {**self.inner.stats(), **mine, "codec": self.stage.ident,
                "codec_active": self.active is not None, "codec_gate": self.gate_reason}
