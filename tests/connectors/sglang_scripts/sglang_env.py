"""What SGLang 0.5.23 needs to run its KV-cache classes on a CPU-only torch.

``stub_missing_torchvision``: the slim CPU environment has no torchvision (no build of it
loads beside torch 2.13 CPU), yet two vision-config modules import it at module level; nothing
on the KV-cache path calls it. Not a change to SGLang's behaviour.

``apply_cpu_shim``: the smallest set of replacements that lets SGLang's *own* HiCache
controller and test kit run without a CUDA driver. Each replaces a CUDA-only call with its
CPU meaning and nothing more:

1. host-pool allocation on "cpu" registers the memory with CUDA (``cudaHostRegister``) when
   pinning: allocate it unpinned instead;
2. ``transfer_kv_direct`` (an sgl_kernel op, imported only under CUDA/HIP/XPU): per layer,
   ``dst[dst_idx] = src[src_idx]``;
3. ``get_dummy_flat_data_page`` pins its scratch page: same page, unpinned;
4. the test kit's ``get_device`` raises without an accelerator: "cpu";
5. the ``page_first`` host layout's device copies (``io_backend="kernel"``) take raw device
   pointer tables: for that layout only, ``load_to_device_per_layer`` and
   ``backup_from_device_all_layer`` become their per-layer torch meaning.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import sys
import types
from enum import Enum

import torch

_SHIM_APPLIED = False


def stub_missing_torchvision() -> None:
    if importlib.util.find_spec("torchvision") is not None or "torchvision" in sys.modules:
        return
    from transformers.utils import import_utils

    import_utils.is_torchvision_available()  # cache "absent" before the stub exists
    with contextlib.suppress(ImportError):
        import datasets  # noqa: F401  (probes for torchvision at import)

    class InterpolationMode(Enum):
        NEAREST = "nearest"
        BILINEAR = "bilinear"
        BICUBIC = "bicubic"

    root = types.ModuleType("torchvision")
    transforms = types.ModuleType("torchvision.transforms")
    functional = types.ModuleType("torchvision.transforms.functional")
    functional.InterpolationMode = transforms.InterpolationMode = InterpolationMode
    transforms.functional = functional
    root.transforms = transforms
    root.__version__ = "0.0.0+lmc-test-stub"
    sys.modules.update({"torchvision": root, "torchvision.transforms": transforms,
                        "torchvision.transforms.functional": functional})


def _cpu_transfer_kv_direct(src_layers, dst_layers, src_indices, dst_indices, page_size):
    if len(src_layers) != len(dst_layers):
        raise ValueError(f"{len(src_layers)} source layers, {len(dst_layers)} destination")
    if len(src_indices) == 0:
        return
    si = src_indices.to(torch.int64).cpu()
    di = dst_indices.to(torch.int64).cpu()
    for src, dst in zip(src_layers, dst_layers):
        dst[di] = src[si]


def apply_cpu_shim() -> None:
    global _SHIM_APPLIED
    if _SHIM_APPLIED:
        return
    stub_missing_torchvision()
    import sglang.srt.mem_cache.pool_host.common as host_common
    import sglang.srt.mem_cache.pool_host.mha as host_mha
    import sglang.test.kits.unified_radix_cache.fixtures as fixtures

    def cpu_alloc(dims, dtype, device, pin_memory, allocator,
                  registration_granularity_bytes=None):
        return allocator.allocate(dims, dtype=dtype, device=device)

    def dummy_page(self):
        return torch.zeros((2, self.layer_num, self.page_size, self.head_num, self.head_dim),
                           dtype=self.dtype, device=self.device).flatten()

    cls = host_mha.MHATokenToKVPoolHost
    load, backup = cls.load_to_device_per_layer, cls.backup_from_device_all_layer

    def load_per_layer(self, device_pool, host_indices, device_indices, layer_id, io_backend,
                       **kw):
        if self.layout != "page_first":
            return load(self, device_pool, host_indices, device_indices, layer_id, io_backend,
                        **kw)
        hi, di = host_indices.to(torch.int64).cpu(), device_indices.to(torch.int64).cpu()
        self.device_k_buffers[layer_id][di] = self.k_buffer[hi, layer_id]
        self.device_v_buffers[layer_id][di] = self.v_buffer[hi, layer_id]

    def backup_all_layers(self, device_pool, host_indices, device_indices, io_backend):
        if self.layout != "page_first":
            return backup(self, device_pool, host_indices, device_indices, io_backend)
        hi, di = host_indices.to(torch.int64).cpu(), device_indices.to(torch.int64).cpu()
        for layer in range(self.layer_num):
            self.k_buffer[hi, layer] = self.device_k_buffers[layer][di]
            self.v_buffer[hi, layer] = self.device_v_buffers[layer][di]

    cls.load_to_device_per_layer = load_per_layer
    cls.backup_from_device_all_layer = backup_all_layers
    host_common.ALLOC_MEMORY_FUNCS["cpu"] = cpu_alloc
    host_mha.transfer_kv_direct = _cpu_transfer_kv_direct
    host_mha.MHATokenToKVPoolHost.get_dummy_flat_data_page = dummy_page
    fixtures.get_device = lambda *a, **k: "cpu"
    _SHIM_APPLIED = True


class LogLines(logging.Handler):
    """The messages logged at ``level`` or above (what a test reads of lmc's log)."""

    def __init__(self, level: int = logging.INFO) -> None:
        super().__init__(level)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())
