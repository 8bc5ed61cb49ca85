"""A vLLM rank in a process of its own, for ``test_vllm_tagged_prefetch``: a real CacheEngine
over L1 and a disk tier holding one prompt in three chains (plain, salt A, salt B; on disk
only), answering lookups and prefetches on a real lookup socket.

``python -m tests.connectors.vllm.tagged_prefetch_rank SOCKET DISK_DIR`` prints ``ready``,
then answers each line on stdin: ``l1`` prints the chunks of each chain in L1 (JSON);
``load NAME`` loads that chain and prints ``exact from L1`` when every bit matches what was
stored and the disk was not read. It exits when stdin closes."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from lmc.connectors.core.lookup_service import LookupServer, engine_lookup, engine_prefetch
from tests.connectors.core.test_tagged_prefetch import Stored


def main(path: str, disk: str) -> None:
    stored = Stored(Path(disk))
    server = LookupServer(path, engine_lookup(lambda: stored.engine),
                          prefetch=engine_prefetch(lambda: stored.engine))
    print("ready", flush=True)
    try:
        for line in sys.stdin:
            words = line.split()
            if words == ["l1"]:
                print(json.dumps(stored.in_l1()), flush=True)
            elif len(words) == 2 and words[0] == "load":
                try:
                    stored.assert_loads_from_l1(words[1])
                    print("exact from L1", flush=True)
                except AssertionError as e:
                    print(f"differs: {e}".replace("\n", " "), flush=True)
    finally:
        server.close()
        stored.engine.close()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
