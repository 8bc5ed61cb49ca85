"""vLLM's use of the lookup service (:mod:`lmc.connectors.core.lookup_service`).

vLLM builds the scheduler-side connector in the EngineCore process and the worker-side one
in each worker process (tensor-parallel rank); the ``CacheEngine`` and its tiers live in
the workers, so the scheduler asks them over the engine-neutral lookup service. All vLLM
adds is the addressing: one socket per (``kv_transfer_config.engine_id``, data-parallel
rank, tensor-parallel rank), in ``vllm.lookup_dir``. Why a socket, the wire format and the
failure rules are in :mod:`lmc.connectors.core.lookup_service`.
"""

from __future__ import annotations

import os

from lmc.connectors.core.lookup_service import socket_path


def socket_paths(directory: str | os.PathLike, engine_id: str, dp_rank: int, tp_size: int
                 ) -> list[str]:
    """The lookup socket of every tensor-parallel rank of one vLLM engine (index = rank)."""
    if tp_size < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {tp_size}")
    return [socket_path(directory, engine_id, dp_rank, r) for r in range(tp_size)]
