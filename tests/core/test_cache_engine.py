"""CacheEngine end to end on the CPU: round trips for every layout and dtype, cross-layout
loads, prefix / partial-chunk / mask / dedup behaviour, eviction under pins, threads."""

from __future__ import annotations

import threading

import pytest
import torch

from lmc import CacheConfig, CacheEngine, KVSpec
from lmc.transfer.kv_spec import LAYOUTS
from tests.kvutil import DTYPES, assert_bits_equal, make_caches, random_tokens, spec_for, token_kv

CHUNK = 16


def _cfg(**kw) -> CacheConfig:
    return CacheConfig(**{"chunk_size": CHUNK, "local_cpu_size": "8MiB", **kw})


def _slots_for(spec: KVSpec, n: int, seed: int) -> torch.Tensor:
    """A random paged allocation: shuffled whole blocks, like an engine's block manager."""
    g = torch.Generator().manual_seed(seed)
    bs = spec.block_size
    blocks = torch.randperm(spec.num_blocks, generator=g)[: -(-n // bs)]
    return (blocks[:, None] * bs + torch.arange(bs)).flatten()[:n]


def _engine(caches, layout, **cfg) -> CacheEngine:
    return CacheEngine(_cfg(**cfg), spec_for(layout, caches), model_id="test-model")


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_store_retrieve_bit_exact_under_new_slot_mapping(layout, dtype):
    n = 40  # two full chunks and a partial one
    src = make_caches(layout, dtype=dtype, blocks=16, block_size=4)
    dst = make_caches(layout, dtype=dtype, blocks=16, block_size=4, zeros=True)
    spec = spec_for(layout, src)
    toks = random_tokens(n)
    s1, s2 = _slots_for(spec, n, 1), _slots_for(spec, n, 2)
    with _engine(src, layout) as eng:
        assert eng.store(toks, src, s1) == n
        assert eng.lookup(toks) == n
        assert eng.retrieve(toks, dst, s2) == n
    assert_bits_equal(token_kv(spec, dst, s2), token_kv(spec, src, s1), layout)


@pytest.mark.parametrize("dst_layout", ["sglang_mha", "vllm_cpu", "vllm_flashinfer"])
def test_cross_layout_load_is_bit_exact(dst_layout):
    """KV stored from vLLM's flash layout loads into another engine's layout, same model."""
    n = 48
    src = make_caches("vllm_flash", dtype=torch.bfloat16, blocks=16, block_size=4)
    dst = make_caches(dst_layout, dtype=torch.bfloat16, blocks=16, block_size=4, zeros=True)
    sspec, dspec = spec_for("vllm_flash", src), spec_for(dst_layout, dst)
    assert sspec.namespace_fields() == dspec.namespace_fields()
    toks = random_tokens(n)
    s1, s2 = _slots_for(sspec, n, 3), _slots_for(dspec, n, 4)
    with CacheEngine(_cfg(), sspec, "m") as a:
        a.store(toks, src, s1)
        objs = a.storage.get_prefix(a.db.keys(toks))
        with CacheEngine(_cfg(), dspec, "m") as b:
            # Same namespace -> same keys; copy the chunks over as a shared tier would (into
            # b's own pool: an L1 tier holds objects of its pool only).
            assert b.db.keys(toks) == a.db.keys(toks)
            copies = [b.storage.allocate(o.shape, o.dtype, o.num_tokens) for o in objs]
            for c, o in zip(copies, objs):
                c.tensor.copy_(o.tensor)
                o.release()
            b.storage.put(b.db.keys(toks), copies)
            for c in copies:
                c.release()
            assert b.retrieve(toks, dst, s2) == n
    assert_bits_equal(token_kv(dspec, dst, s2), token_kv(sspec, src, s1), dst_layout)


def test_prefix_hits_and_divergence():
    src = make_caches("vllm_flash", blocks=32, block_size=4)
    spec = spec_for("vllm_flash", src)
    base = random_tokens(64)
    with _engine(src, "vllm_flash") as eng:
        eng.store(base, src, _slots_for(spec, 64, 0))
        assert eng.lookup(base) == 64
        assert eng.lookup(base[:40]) == 32  # partial tail of 8 tokens was never stored
        assert eng.lookup(base[:48]) == 48
        diverged = base[:20] + [1] + base[21:]
        assert eng.lookup(diverged) == 16   # chunk 1 differs, so every later chunk differs
        assert eng.lookup([7] + base[1:]) == 0
        assert eng.lookup(base + [5, 6, 7]) == 64


def test_partial_chunk_saved_only_when_configured():
    src = make_caches("vllm_flash", blocks=32, block_size=4)
    spec = spec_for("vllm_flash", src)
    toks = random_tokens(40)
    for save_unfull, expect in [(True, 40), (False, 32)]:
        with _engine(src, "vllm_flash", save_unfull_chunk=save_unfull) as eng:
            assert eng.store(toks, src, _slots_for(spec, 40, 0)) == expect
            assert eng.lookup(toks) == expect


def test_mask_skips_a_chunk_aligned_prefix():
    src = make_caches("vllm_flash", blocks=32, block_size=4)
    dst = make_caches("vllm_flash", blocks=32, block_size=4, zeros=True)
    spec = spec_for("vllm_flash", src)
    toks, slots = random_tokens(48), _slots_for(spec, 48, 0)
    mask = torch.ones(48, dtype=torch.bool)
    mask[:16] = False
    with _engine(src, "vllm_flash") as eng:
        assert eng.store(toks, src, slots, mask=mask) == 32
        assert eng.lookup(toks) == 0           # chunk 0 was never stored: no prefix hit
        assert eng.retrieve(toks, dst, slots, mask=mask) == 32
        assert_bits_equal(token_kv(spec, dst, slots[16:]), token_kv(spec, src, slots[16:]))
        assert bool((token_kv(spec, dst, slots[:16]) == 0).all()), "masked prefix written"
        bad = torch.ones(48, dtype=torch.bool)
        bad[:10] = False
        with pytest.raises(ValueError, match="multiple of chunk_size"):
            eng.store(toks, src, slots, mask=bad)
        holes = torch.ones(48, dtype=torch.bool)
        holes[20] = False
        with pytest.raises(ValueError, match="False prefix"):
            eng.store(toks, src, slots, mask=holes)


def test_dedup_skips_present_chunks_without_copying():
    src = make_caches("vllm_flash", blocks=32, block_size=4)
    spec = spec_for("vllm_flash", src)
    toks, slots = random_tokens(64), _slots_for(spec, 64, 0)
    with _engine(src, "vllm_flash") as eng:
        assert eng.store(toks[:32], src, slots[:32]) == 32
        used = eng.pool.used_bytes
        assert eng.store(toks, src, slots) == 32         # only the two new chunks
        assert eng.store(toks, src, slots) == 0
        assert eng.pool.used_bytes == used * 2
        assert eng.stats()["skipped_present"] == 2 + 4


def test_unmapped_slots_are_not_stored():
    src = make_caches("vllm_flash", blocks=32, block_size=4)
    spec = spec_for("vllm_flash", src)
    toks, slots = random_tokens(48), _slots_for(spec, 48, 0).clone()
    slots[20] = -1
    with _engine(src, "vllm_flash") as eng:
        assert eng.store(toks, src, slots) == 16 + 16    # chunk 1 skipped, chunks 0 and 2 kept
        assert eng.lookup(toks) == 16
        assert eng.stats()["skipped_unmapped_slots"] == 1


def test_a_chunk_of_the_wrong_shape_ends_the_loaded_prefix_and_leaks_nothing():
    """A held chunk whose shape or dtype is not this engine's (another engine's spec under
    the same key) is a miss: the prefix before it loads, it and the rest are released."""
    n = 56  # three full chunks and a partial one
    src = make_caches("vllm_flash", blocks=32, block_size=4)
    dst = make_caches("vllm_flash", blocks=32, block_size=4, zeros=True)
    spec = spec_for("vllm_flash", src)
    toks, s1, s2 = random_tokens(n), _slots_for(spec, n, 1), _slots_for(spec, n, 2)
    with _engine(src, "vllm_flash") as eng:
        assert eng.store(toks, src, s1) == n
        keys = eng.db.keys(toks)
        for bad, (shape, dtype) in ((3, (spec.chunk_shape(CHUNK), spec.dtype)),
                                    (1, (spec.chunk_shape(n - 3 * CHUNK), spec.dtype)),
                                    (2, (spec.chunk_shape(CHUNK), torch.float16))):
            eng.storage.l1.delete([keys[bad]])
            o = eng.pool.allocate(shape, dtype, 8)
            eng.storage.l1.put([keys[bad]], [o])
            o.release()
            assert eng.retrieve(toks, dst, s2) == bad * CHUNK
            got, want = token_kv(spec, dst, s2), token_kv(spec, src, s1)
            assert_bits_equal(got[:, :, : bad * CHUNK], want[:, :, : bad * CHUNK])
            eng.storage.l1.delete([keys[bad]])
            assert eng.store(toks, src, s1) == (n - 3 * CHUNK if bad == 3 else CHUNK)
        assert eng.retrieve(toks, dst, s2) == n


def test_eviction_respects_pins_and_skips_when_all_pinned():
    src = make_caches("vllm_flash", layers=2, heads=2, dim=64, blocks=64, block_size=4)
    spec = spec_for("vllm_flash", src)
    chunk_bytes = spec.chunk_nbytes(CHUNK)  # 16 KiB
    with _engine(src, "vllm_flash", local_cpu_size=4 * chunk_bytes) as eng:
        a, b = random_tokens(32, 1), random_tokens(32, 2)
        assert eng.store(a, src, _slots_for(spec, 32, 1)) == 32
        assert eng.lookup(a, pin=True) == 32
        # a is pinned: storing b fills the pool, then c cannot evict a -> skipped, counted
        assert eng.store(b, src, _slots_for(spec, 32, 2)) == 32
        c = random_tokens(32, 3)
        eng.lookup(b, pin=True)
        assert eng.store(c, src, _slots_for(spec, 32, 3)) == 0
        assert eng.stats()["skipped_pool_full"] == 2
        assert eng.lookup(a) == 32 and eng.lookup(b) == 32
        assert eng.unpin(a) == 2
        assert eng.store(c, src, _slots_for(spec, 32, 3)) == 32  # evicts a, never b
        assert eng.lookup(a) == 0 and eng.lookup(b) == 32 and eng.lookup(c) == 32


def test_retrieve_releases_lookup_pins():
    src = make_caches("vllm_flash", blocks=32, block_size=4)
    dst = make_caches("vllm_flash", blocks=32, block_size=4, zeros=True)
    spec = spec_for("vllm_flash", src)
    toks, slots = random_tokens(32), _slots_for(spec, 32, 0)
    with _engine(src, "vllm_flash") as eng:
        eng.store(toks, src, slots)
        eng.lookup(toks, pin=True)
        assert eng.stats()["pinned_chunks"] == 2
        eng.retrieve(toks, dst, slots)
        assert eng.stats()["pinned_chunks"] == 0
        assert all(o.ref_count == 1 for o in eng.storage.l1._map.values())


def test_eight_threads_store_and_retrieve_without_corruption():
    layout = "vllm_flash"
    src = make_caches(layout, blocks=256, block_size=4, dtype=torch.float16)
    spec = spec_for(layout, src)
    errors: list[BaseException] = []
    with _engine(src, layout, local_cpu_size="1MiB") as eng:  # small: eviction races too
        def worker(i: int) -> None:
            try:
                dst = make_caches(layout, blocks=256, block_size=4, dtype=torch.float16,
                                  zeros=True)
                for r in range(12):
                    n = 16 * (1 + (i + r) % 4) + (r % 3)
                    toks = random_tokens(n, seed=(i * 7 + r) % 10)  # overlapping prompts
                    s_in = _slots_for(spec, n, seed=(i * 7 + r) % 10)
                    eng.store(toks, src, s_in)
                    s_out = _slots_for(spec, n, seed=100 + i)
                    got = eng.retrieve(toks, dst, s_out)
                    if got:
                        assert_bits_equal(token_kv(spec, dst, s_out[:got]),
                                          token_kv(spec, src, s_in[:got]), f"thread {i}")
            except BaseException as e:  # noqa: BLE001 - reported below
                errors.append(e)

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors[0]
        assert eng.stats()["pinned_chunks"] == 0
        assert all(o.ref_count == 1 for o in eng.storage.l1._map.values())


def test_bad_input_is_named():
    src = make_caches("vllm_flash", blocks=32, block_size=4)
    toks = random_tokens(32)
    with _engine(src, "vllm_flash") as eng:
        with pytest.raises(ValueError, match="31 entries for 32 tokens"):
            eng.store(toks, src, torch.arange(31))
        wrong = make_caches("vllm_flash", blocks=32, block_size=4, dtype=torch.float16)
        with pytest.raises(TypeError, match="layer0 has dtype torch.float16"):
            eng.store(toks, wrong, torch.arange(32))
        shaped = make_caches("vllm_flash", blocks=32, block_size=4, heads=3)
        with pytest.raises(ValueError, match=r"layer0 has shape \(2, 32, 4, 3, 8\)"):
            eng.retrieve(toks, shaped, torch.arange(32))
        with pytest.raises(ValueError, match="has 2 layers, spec expects 3"):
            eng.store(toks, src[:2], torch.arange(32))
        with pytest.raises(TypeError, match="tokens must be"):
            eng.lookup("hello")
        with pytest.raises(ValueError, match="token ids"):
            eng.lookup([1, -5, 3])
        assert eng.lookup(toks) == 0, "nothing partly stored after failed calls"


def test_failed_gather_leaves_nothing_visible(monkeypatch):
    src = make_caches("vllm_flash", blocks=32, block_size=4)
    spec = spec_for("vllm_flash", src)
    toks, slots = random_tokens(32), _slots_for(spec, 32, 0)
    with _engine(src, "vllm_flash") as eng:
        tr = eng.transfer_for(src)

        def boom(*a, **k):
            raise RuntimeError("device lost")

        monkeypatch.setattr(tr, "gather", boom)
        with pytest.raises(RuntimeError, match="device lost"):
            eng.store(toks, src, slots)
        assert eng.lookup(toks) == 0
        assert eng.pool.used_bytes == 0, "objects of a failed store must return to the pool"


def test_restoring_a_present_prefix_refreshes_its_lru_position():
    src = make_caches("vllm_flash", layers=2, heads=2, dim=64, blocks=64, block_size=4)
    spec = spec_for("vllm_flash", src)
    chunk_bytes = spec.chunk_nbytes(CHUNK)
    with _engine(src, "vllm_flash", local_cpu_size=4 * chunk_bytes) as eng:
        hot, b, c = random_tokens(32, 1), random_tokens(32, 2), random_tokens(32, 3)
        eng.store(hot, src, _slots_for(spec, 32, 1))
        eng.store(b, src, _slots_for(spec, 32, 2))
        assert eng.store(hot, src, _slots_for(spec, 32, 1)) == 0  # present: skipped, touched
        eng.store(c, src, _slots_for(spec, 32, 3))                  # evicts b, not hot
        assert eng.lookup(hot) == 32 and eng.lookup(b) == 0 and eng.lookup(c) == 32


# ------------------------------------------------------- bound caches are held weakly
def _dropped_cache_is_freed(layout: str, wrap) -> None:
    import gc
    import weakref

    src = make_caches(layout, blocks=32, block_size=4)
    spec = spec_for(layout, src)
    toks, slots = random_tokens(32), _slots_for(spec, 32, 0)
    with _engine(src, layout) as eng:
        eng.store(toks, wrap(src), slots)
        dst = make_caches(layout, blocks=32, block_size=4, zeros=True)
        caches = wrap(dst)
        assert eng.retrieve(toks, caches, slots) == 32
        tr = weakref.ref(eng.transfer_for(caches))
        assert eng.transfer_for(caches) is tr(), "a live cache's transfer is reused"
        watched = [weakref.ref(t) for t in _leaves(dst)]
        del dst, caches
        gc.collect()
        assert all(w() is None for w in watched), "the engine kept a dropped cache's tensors"
        assert tr() is None, "the engine kept the transfer (and the memory) of a dropped cache"
        assert len(eng._transfers) == 1  # only src's, which the test still holds
        assert eng.lookup(toks) == 32


def _leaves(caches):
    from lmc.transfer.bound_caches import leaf_tensors
    return leaf_tensors(caches)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_dropped_kv_cache_is_freed_not_kept_by_the_engine(layout):
    _dropped_cache_is_freed(layout, lambda c: c)


def test_a_dropped_kv_cache_passed_as_a_mapping_is_freed():
    _dropped_cache_is_freed(
        "vllm_flash", lambda c: {f"model.layers.{i}.attn": t for i, t in enumerate(c)})


def test_a_new_cache_at_a_freed_cache_address_gets_its_own_transfer():
    """A cache dropped and reallocated (same address, shape and strides) must bind anew: the
    old binding's callback must not unbind the new one either."""
    import gc

    src = make_caches("vllm_flash", blocks=32, block_size=4)
    spec = spec_for("vllm_flash", src)
    toks, slots = random_tokens(32), _slots_for(spec, 32, 0)
    with _engine(src, "vllm_flash") as eng:
        eng.store(toks, src, slots)
        for _ in range(3):
            dst = make_caches("vllm_flash", blocks=32, block_size=4, zeros=True)
            assert eng.retrieve(toks, dst, slots) == 32
            assert_bits_equal(token_kv(spec, dst, slots), token_kv(spec, src, slots), "load")
            del dst
            gc.collect()
            assert len(eng._transfers) == 1


def test_at_most_four_caches_are_bound():
    src = make_caches("vllm_flash", blocks=32, block_size=4)
    spec = spec_for("vllm_flash", src)
    toks, slots = random_tokens(32), _slots_for(spec, 32, 0)
    with _engine(src, "vllm_flash") as eng:
        eng.store(toks, src, slots)
        held = [make_caches("vllm_flash", blocks=32, block_size=4, zeros=True) for _ in range(6)]
        for d in held:
            assert eng.retrieve(toks, d, slots) == 32
        assert len(eng._transfers) == 4


def test_fresh_views_of_one_cache_reuse_its_transfer_and_free_it_when_dropped():
    """A caller that passes new view objects of the same cache on every call must not pay a
    transfer build (layer validation, tables) per call; the base is what is watched."""
    import gc
    import weakref

    src = make_caches("vllm_flash", blocks=32, block_size=4)
    spec = spec_for("vllm_flash", src)
    toks, slots = random_tokens(32), _slots_for(spec, 32, 0)
    with _engine(src, "vllm_flash") as eng:
        eng.store(toks, src, slots)
        base = make_caches("vllm_flash", blocks=32, block_size=4, zeros=True)
        first = weakref.ref(eng.transfer_for([t.view(t.shape) for t in base]))
        gc.collect()  # the first call's views are gone
        for _ in range(3):
            assert eng.retrieve(toks, [t.view(t.shape) for t in base], slots) == 32
            assert eng.transfer_for([t.view(t.shape) for t in base]) is first()
        assert_bits_equal(token_kv(spec, base, slots), token_kv(spec, src, slots), "load")
        watched = [weakref.ref(t) for t in base]
        del base
        gc.collect()
        assert all(w() is None for w in watched) and first() is None, \
            "the engine kept a dropped cache reached through views"


@pytest.mark.gpu
def test_a_dropped_cuda_cache_returns_its_gpu_memory():
    """Where it matters most: GPU memory of a cache the engine had bound (vLLM reallocating
    its KV cache after profiling) is given back once the caller drops it."""
    import gc

    src = make_caches("vllm_flash", blocks=32, block_size=4, device="cuda")
    spec = spec_for("vllm_flash", src)
    toks, slots = random_tokens(32), _slots_for(spec, 32, 0).cuda()
    with _engine(src, "vllm_flash") as eng:
        eng.store(toks, src, slots)
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        dst = make_caches("vllm_flash", blocks=4096, block_size=4, zeros=True, device="cuda")
        assert torch.cuda.memory_allocated() > before
        assert eng.retrieve(toks, dst, slots) == 32
        del dst
        gc.collect()
        torch.cuda.synchronize()
        assert torch.cuda.memory_allocated() <= before, "the engine kept a dropped GPU cache"


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("blocks", [8, 64])
def test_a_recreated_cache_with_another_block_count_is_accepted(layout, blocks):
    """vLLM allocates its KV cache after profiling, and sleep/wake re-creates it: the engine
    is bound to the cache's geometry, not its number of blocks, so KV stored from the first
    cache loads into a re-created one (fewer or more blocks) and stores from it work."""
    n = 32
    src = make_caches(layout, blocks=16, block_size=4)
    spec = spec_for(layout, src)
    assert spec.num_blocks > 0  # from_tensors reads the first cache's capacity into the spec
    toks = random_tokens(n)
    with _engine(src, layout) as eng:
        eng.store(toks, src, _slots_for(spec, n, 0))
        again = make_caches(layout, blocks=blocks, block_size=4, zeros=True)
        aspec = spec_for(layout, again)
        slots = _slots_for(aspec, n, 1)
        assert eng.retrieve(toks, again, slots) == n
        assert_bits_equal(token_kv(aspec, again, slots),
                          token_kv(spec, src, _slots_for(spec, n, 0)), f"{layout} re-created")
        more = random_tokens(n, seed=9)
        assert eng.store(more, again, slots) == n  # the new cache stores too
        assert eng.lookup(more) == n


@pytest.mark.parametrize("change", ["heads", "dim", "block_size", "dtype", "layers"])
def test_a_cache_of_another_geometry_is_still_refused(change):
    """Binding by geometry is not binding to anything: a cache of another model (heads, head
    size, block size, dtype, layer count) is refused with an error naming what differs."""
    src = make_caches("vllm_flash", blocks=16, block_size=4)
    kw = {"heads": dict(heads=4), "dim": dict(dim=16), "block_size": dict(block_size=8),
          "dtype": dict(dtype=torch.float16), "layers": dict(layers=2)}[change]
    other = make_caches("vllm_flash", **{"blocks": 16, "block_size": 4, **kw})
    with _engine(src, "vllm_flash") as eng:
        eng.store(random_tokens(16), src, torch.arange(16))
        with pytest.raises((ValueError, TypeError), match="kv cache|kv_caches has"):
            eng.retrieve(random_tokens(16), other, torch.arange(16))


def test_a_recreated_cache_slot_past_its_end_is_refused():
    """The bound is the re-created cache's own: a slot that fitted the first cache but not
    the smaller one is an error naming the slot, never a write past its end."""
    src = make_caches("vllm_flash", blocks=16, block_size=4)
    spec = spec_for("vllm_flash", src)
    with _engine(src, "vllm_flash") as eng:
        eng.store(random_tokens(16), src, torch.arange(16))
        small = make_caches("vllm_flash", blocks=2, block_size=4, zeros=True)
        with pytest.raises(ValueError, match="slot 15.*only 8 slots"):
            eng.retrieve(random_tokens(16), small, torch.arange(16))
    assert spec.num_blocks == 16


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["calibrated", "direct", "staged"])
def test_gpu_layerwise_round_trip_into_a_recreated_cache(mode, monkeypatch):
    """On a GPU, end to end: layer-wise store from one CUDA cache through the pinned pool,
    layer-wise retrieve into a re-created cache with another block count, the engine's
    stream ordered after each layer's load by its handle; both copy paths and the
    calibrated choice; the path shows in stats."""
    for var in ("LMC_CUDA_GATHER_MODE", "LMC_CUDA_SCATTER_MODE"):
        if mode == "calibrated":
            monkeypatch.delenv(var, raising=False)
        else:
            monkeypatch.setenv(var, mode)
    src = make_caches("vllm_flash", layers=4, blocks=64, block_size=4, dtype=torch.bfloat16,
                      device="cuda")
    spec = spec_for("vllm_flash", src)
    n = 64
    toks, slots = random_tokens(n, seed=3), _slots_for(spec, n, 5)
    with _engine(src, "vllm_flash", local_cpu_size="16MiB") as eng:
        assert eng.pool.stats()["pinned"] == 1
        st = eng.store_layer(toks, src, slots)
        for layer in range(spec.num_layers):
            st.save(layer)
        assert st.commit() == n
        dst = make_caches("vllm_flash", layers=4, blocks=40, block_size=4,
                          dtype=torch.bfloat16, zeros=True, device="cuda")
        dspec = spec_for("vllm_flash", dst)
        dslots = _slots_for(dspec, n, 6)
        compute = torch.cuda.current_stream()
        with eng.retrieve_layer(toks, dst, dslots) as rt:
            rt.start()
            for layer in range(spec.num_layers):
                rt.wait(layer, compute)
                got = token_kv(dspec, dst, dslots)[layer]  # read on the engine's stream
                assert_bits_equal(got, token_kv(spec, src, slots)[layer], f"{mode} {layer}")
        if not hasattr(eng.transfer_for(dst), "path_stats"):
            return  # wrapped (tests/core/test_late_engine.py's late copies): no path stats
        s = eng.stats()
        assert s["copy_path.scatter.per_layer"] in ("direct", "staged")
        if mode != "calibrated":
            assert s["copy_path.scatter.per_layer"] == mode
            assert s[f"copy_calls.scatter.per_layer.{mode}"] == spec.num_layers


def test_the_engine_counts_its_disk_tiers_evictions(tmp_path):
    """Lower tiers' own evictions reach the engine's metrics (``evictions_disk``,
    ``lmc_evictions{tier="disk"}``) through its eviction listener."""
    src = make_caches("vllm_flash", blocks=64, block_size=4)
    spec = spec_for("vllm_flash", src)
    with _engine(src, "vllm_flash", local_disk=str(tmp_path), local_disk_size="48KiB") as eng:
        for seed in range(4):
            toks = random_tokens(32, seed=seed)
            assert eng.store(toks, src, _slots_for(spec, 32, seed)) == 32
            assert eng.storage.flush(10)
        assert eng.metrics.counts.get("evictions_disk", 0) > 0, eng.metrics.counts
