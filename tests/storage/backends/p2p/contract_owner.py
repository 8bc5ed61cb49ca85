"""The owner side of the P2P contract tier (``tests/storage/backends/p2p/test_contract_p2p.py``):
a process holding one P2P tier per contract tier, each over a pool of its own, driven by
JSON lines on stdin (one ``@lmc`` JSON answer line each). Chunks arrive as bytes, so what the
reader READs back is exactly what the suite stored. Ends with ``os._exit`` (NIXL's exit-time
crash, see :mod:`lmc.storage.backends.p2p.agent`). Threat model: ``docs/threats/p2p.md``.

Commands: ``open {id, url, token, secret}``, ``put {id, items: [[key, shape, dtype, b64]]}``,
``delete {id, keys}``, ``damage {id, key}`` (flip a byte of the exported copy; a keyed owner
then re-advertises the record with the checksum recomputed, so only the tag can tell),
``close {id}``, ``exit``. Keys are hex.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import os
import sys

import torch

from lmc.config import CacheConfig
from lmc.memory.pool import MemoryPool
from lmc.storage.backends.p2p.backend import P2PBackend
from lmc.storage.serde import payload_checksum

POOL_BYTES = 16 << 20


class Owners:
    def __init__(self) -> None:
        self.tiers: dict[str, P2PBackend] = {}

    def open(self, id: str, url: str, token: str | None, secret: str | None) -> dict:
        cfg = CacheConfig(remote_timeout=1.0, pin_memory="false", remote_token=token,
                          integrity_secret=secret)
        pool = MemoryPool(POOL_BYTES, pin_memory="false", prefault="off")
        self.tiers[id] = P2PBackend(url, config=cfg, pool=pool, agent_name=f"owner-{id}")
        return {"agent": f"owner-{id}"}

    def put(self, id: str, items: list) -> dict:
        tier = self.tiers[id]
        keys, objs = [], []
        try:
            for key, shape, dtype, data in items:
                o = tier.pool.allocate(shape, getattr(torch, dtype), shape[-2])
                if o is None:
                    break
                objs.append(o)
                keys.append(bytes.fromhex(key))
                o.tensor.reshape(-1).view(torch.uint8).copy_(
                    torch.frombuffer(bytearray(base64.b64decode(data)), dtype=torch.uint8))
            return {"stored": tier.put(keys, objs)}
        finally:
            for o in objs:
                o.release()

    def delete(self, id: str, keys: list[str]) -> dict:
        return {"deleted": self.tiers[id].delete([bytes.fromhex(k) for k in keys])}

    def damage(self, id: str, key: str) -> dict:
        tier = self.tiers[id]
        e = tier._exports[bytes.fromhex(key)]
        view = e.obj.tensor.reshape(-1).view(torch.uint8)
        view[100] ^= 0x10
        if tier.integrity is not None:  # a self-consistent record: only the tag can tell
            e.record = dataclasses.replace(e.record,
                                           checksum=payload_checksum(e.obj.byte_view()))
            tier._member.advertise([e.record])
        return {"damaged": True}

    def close(self, id: str) -> dict:
        tier = self.tiers.pop(id)
        tier.close()
        tier.pool.close()
        return {"closed": True}


def main() -> None:
    owners = Owners()
    print("@lmc " + json.dumps({"pid": os.getpid()}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd.pop("op")
        if op == "exit":
            for id in list(owners.tiers):
                owners.close(id)
            print("@lmc " + json.dumps({"exited": True}), flush=True)
            break
        try:
            out = getattr(owners, op)(**cmd)
        except Exception as e:  # answered, so the test sees it
            out = {"error": f"{type(e).__name__}: {e}"}
        print("@lmc " + json.dumps(out), flush=True)
    os._exit(0)


if __name__ == "__main__":
    main()
