"""Layer-wise store/retrieve: same bytes as the one-shot forms, nothing visible early,
failures surface as LoadError and leave nothing behind."""

from __future__ import annotations

import pytest
import torch

from lmc import CacheConfig, CacheEngine, LoadError
from tests.kvutil import assert_bits_equal, make_caches, spec_for, token_kv
from tests.late_transfer import (
    copies,  # noqa: F401 - the fixture below
    )

pytestmark = pytest.mark.usefixtures("copies")  # every test: copies now, then late


def _setup(layout="vllm_flash"):
    src = make_caches(layout, layers=4, blocks=32, block_size=4, dtype=torch.bfloat16)
    dst = make_caches(layout, layers=4, blocks=32, block_size=4, dtype=torch.bfloat16,
                      zeros=True)
    spec = spec_for(layout, src)
    eng = CacheEngine(CacheConfig(chunk_size=16, local_cpu_size="4MiB"), spec, "m")
    toks = list(range(100, 148))
    return eng, spec, src, dst, toks


@pytest.mark.parametrize("sync", [True, False])
def test_layerwise_store_then_layerwise_retrieve(sync):
    eng, spec, src, dst, toks = _setup()
    slots = torch.arange(48)
    with eng:
        st = eng.store_layer(toks, src, slots)
        for layer in range(spec.num_layers):
            st.save(layer, sync=sync)
            assert eng.lookup(toks) == 0, "visible before commit"
        assert st.commit() == 48
        assert eng.lookup(toks) == 48
        slots2 = torch.arange(64, 112)
        with eng.retrieve_layer(toks, dst, slots2) as rt:
            assert rt.num_tokens == 48
            rt.start()
            for layer in range(spec.num_layers):
                rt.wait(layer)
                got = token_kv(spec, dst, slots2)[layer]
                assert_bits_equal(got, token_kv(spec, src, slots)[layer], f"layer {layer}")
        assert eng.stats()["retrieve_tokens"] == 48


def test_commit_before_all_layers_stores_nothing():
    eng, spec, src, _, toks = _setup()
    with eng:
        st = eng.store_layer(toks, src, torch.arange(48))
        st.save(0)
        with pytest.raises(ValueError, match=r"before layers \[1, 2, 3\]"):
            st.commit()
        assert eng.lookup(toks) == 0 and eng.pool.used_bytes == 0


def test_exception_inside_store_context_aborts():
    eng, spec, src, _, toks = _setup()
    with eng:
        with pytest.raises(KeyError), eng.store_layer(toks, src, torch.arange(48)) as st:
            st.save(0)
            raise KeyError("model crashed")
        assert eng.lookup(toks) == 0 and eng.pool.used_bytes == 0


def test_failed_layer_load_raises_load_error_and_releases(monkeypatch):
    eng, spec, src, dst, toks = _setup()
    with eng:
        eng.store(toks, src, torch.arange(48))
        used = eng.pool.used_bytes
        tr = eng.transfer_for(dst)
        real = tr.scatter

        def flaky(plan, bufs, layers=None, **kw):
            if list(layers) == [2]:
                raise OSError("injected: DMA error on layer 2")
            return real(plan, bufs, layers, **kw)

        monkeypatch.setattr(tr, "scatter", flaky)
        rt = eng.retrieve_layer(toks, dst, torch.arange(48)).start()
        rt.wait(0)
        rt.wait(1)
        with pytest.raises(LoadError, match="layer 2"):
            rt.wait(2)
        assert rt.close() == 0
        assert all(o.ref_count == 1 for o in eng.storage.l1._map.values())
        assert eng.pool.used_bytes == used


def test_layer_index_checked():
    eng, spec, src, _, toks = _setup()
    with eng:
        st = eng.store_layer(toks, src, torch.arange(48))
        with pytest.raises(ValueError, match=r"layer 4 out of range \[0, 4\)"):
            st.save(4)
        st.save(0)
        with pytest.raises(ValueError, match="saved twice"):
            st.save(0)
        st.abort()



class PlainHost:
    """A LayerwiseHost that is not a CacheEngine: a dict of committed chunks and a thread."""

    def __init__(self, num_layers: int) -> None:
        from concurrent.futures import ThreadPoolExecutor

        self.num_layers = num_layers
        self.pool = ThreadPoolExecutor(1)
        self.committed: dict[bytes, torch.Tensor] = {}
        self.transfers: list[tuple[str, int]] = []

    def executor(self):
        return self.pool

    def commit_chunks(self, keys, objs) -> None:
        for k, o in zip(keys, objs):
            self.committed[k] = o.tensor.clone()

    def record_transfer(self, kind, tokens, nbytes, seconds) -> None:
        self.transfers.append((kind, tokens))


def test_layerwise_objects_need_only_the_declared_host():
    """lmc.layerwise reaches the engine through LayerwiseHost alone: a store and a retrieve
    run against a host with no tiers, metrics or pins, and the module imports no engine."""
    import ast
    import inspect

    from lmc import layerwise
    from lmc.layerwise import LayerwiseRetrieve, LayerwiseStore

    imported = {n.module for n in ast.walk(ast.parse(inspect.getsource(layerwise)))
                if isinstance(n, ast.ImportFrom)}
    assert "lmc.cache_engine" not in imported
    eng, spec, src, dst, toks = _setup()
    with eng:
        host = PlainHost(spec.num_layers)
        tr = eng.transfer_for(src)
        chunks = eng.db.process_tokens(toks)
        objs = eng.pool.allocate_many(spec.chunk_shape(16), spec.dtype, len(chunks), 16)
        st = LayerwiseStore(host, tr, tr.plan(torch.arange(48), [(s, e) for s, e, _ in chunks]),
                            chunks, objs)
        for layer in range(spec.num_layers):
            st.save(layer)
        assert st.commit() == 48 and host.transfers == [("store", 48)]
        assert list(host.committed) == [k for _, _, k in chunks]
        back = eng.pool.allocate_many(spec.chunk_shape(16), spec.dtype, len(chunks), 16)
        for o, (_, _, k) in zip(back, chunks):
            o.tensor.copy_(host.committed[k])
        slots2 = torch.arange(64, 112)
        dtr = eng.transfer_for(dst)
        rt = LayerwiseRetrieve(host, dtr, dtr.plan(slots2, [(s, e) for s, e, _ in chunks]),
                               chunks, back, ["dict"] * len(chunks))
        rt.start()
        for layer in range(spec.num_layers):
            rt.wait(layer)
        assert rt.close() == 48 and rt.tokens_by_tier(10, 40) == {"dict": 30}
        assert_bits_equal(token_kv(spec, dst, slots2), token_kv(spec, src, torch.arange(48)),
                          "through a plain host")
        with pytest.raises(ValueError, match="2 tier names for 3 chunks"):
            LayerwiseRetrieve(host, dtr, None, chunks, [], ["a", "b"])
        host.pool.shutdown()
