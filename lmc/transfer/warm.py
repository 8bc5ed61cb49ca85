"""Pay a CUDA transfer's first-use costs when lmc binds an engine's KV cache, not inside the
first request that copies.

Why: the first gather and the first scatter of a process pay for loading the kernels (NVRTC,
or CuPy's on-disk cache), the first launches of each kernel, the first staging buffers on
lmc's copy stream and the first pinned uploads of a copy plan. Inside a request that is TTFT
(on an H100 the first L1 hit after a cold prefill took 0.5-0.9 s against 56-88 ms for the
next ones); at registration it is start-up time, where an engine already spends seconds.

The round trip runs on a *scratch* cache of a few blocks with the engine's geometry, dtype and
copy paths, never on the engine's own cache: a registration can come while another thread's
stream writes that cache (a ``CacheEngine`` user binding a new cache mid-serving), and a
gather-then-scatter of live slots could write back stale bytes. The copies use lmc's copy
stream (:func:`~lmc.transfer.completion.copy_stream`), as the layer-wise copies do.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from lmc.transfer.completion import copy_stream
from lmc.transfer.kv_spec import DESCRIPTORS, KVCaches, KVSpec
from lmc.transfer.plan import KVTransfer

log = logging.getLogger(__name__)

#: A host chunk buffer of ``shape`` and ``dtype`` for the duration of the ``with``: the pool's
#: memory where lmc has one (its registrations are what the real copies read and write).
HostBuffer = Callable[[tuple[int, ...], torch.dtype], contextlib.AbstractContextManager[torch.Tensor]]


@contextlib.contextmanager
def pinned_buffer(shape: tuple[int, ...], dtype: torch.dtype) -> Iterator[torch.Tensor]:
    """Default :data:`HostBuffer`: torch's page-locked allocator."""
    yield torch.empty(shape, dtype=dtype, pin_memory=torch.cuda.is_available())


def scratch_caches(spec: KVSpec, num_blocks: int, device: torch.device) -> KVCaches:
    """Zeroed caches of ``num_blocks`` blocks in ``spec``'s layout and container form."""
    shape = spec.layer_shape(num_blocks)

    def one() -> torch.Tensor:
        return torch.zeros(shape, dtype=spec.dtype, device=device)

    if DESCRIPTORS[spec.layout].split_planes:
        return ([one() for _ in range(spec.num_layers)], [one() for _ in range(spec.num_layers)])
    return [one() for _ in range(spec.num_layers)]


def warm_up(tr: KVTransfer, host_buffer: HostBuffer = pinned_buffer, *,
            scratch: KVCaches | None = None, backend: Any = None) -> float | None:
    """Gather and scatter one layer and then every layer of a scratch cache shaped like
    ``tr``'s, through ``tr``'s copy paths, waiting for each; returns the seconds it took, or
    None for a transfer with nothing to warm (the CPU path). ``scratch`` and ``backend``
    replace the scratch cache and the CUDA runtime shim (the tests' host emulation)."""
    from lmc.transfer.cuda_copy import CudaTransfer

    if not isinstance(tr, CudaTransfer):
        return None
    t0 = time.perf_counter()
    spec = tr.spec
    tokens = 2 * spec.block_size
    blocks = 3  # two blocks' tokens, one block spare
    if scratch is None:
        scratch = scratch_caches(spec, blocks, tr.device)
    small = dataclasses.replace(spec, num_blocks=0)
    side = CudaTransfer(small, scratch, paths=tr.paths, backend=backend or tr.backend,
                        max_blocks=tr.max_blocks)
    stream = copy_stream(tr.device) if backend is None else None
    with host_buffer(spec.chunk_shape(tokens), spec.dtype) as buf:
        plan = side.plan(torch.arange(tokens, dtype=torch.int64), [(0, tokens)])
        after = side.record_event()  # the scratch's zeroing, queued on the current stream
        for layers in ([0], None):
            side.gather(plan, [buf], layers, stream=stream, after=after).wait()
            side.scatter(plan, [buf], layers, stream=stream).wait()
    return time.perf_counter() - t0
