"""An engine process for the P2P tests, driven by JSON lines on stdin (one JSON answer line
each, marked ``@lmc``): ``python -m tests.storage.backends.p2p.engine_proc DIRECTORY_URL``.

Its tiers are L1 and the P2P tier only, so a chunk it did not store itself can come from a
peer's pool and nowhere else. KV is regenerated from a seed on every side, so a loader checks
bit-exactness against what the owner stored without any side channel. NIXL agents crash at
interpreter exit (see ``lmc.storage.backends.p2p.agent``): ``exit`` closes the engine and ends with
``os._exit``; judge this process by its answers.

Commands: ``store``/``load`` ``{seed, n}``; ``evict`` ``{seed, n}`` (delete the prompt's chunks
everywhere, then store another prompt so the freed memory is reused); ``forget`` (the same,
but the directory is not told); ``churn`` ``{seconds, seeds, n, rng_seed}`` (store and
evict those prompts at random in a thread) and ``churn_wait``; ``drop`` (forget a prompt
locally); ``arm`` ``{when:
before|after, action: kill|signal, pid}`` (the next READ from a peer first SIGKILLs ``pid``,
or sends it SIGUSR1 and waits for its ``evicted`` file); ``stats``; ``exit``.
"""

from __future__ import annotations

import json
import os
import random
import signal
import sys
import threading
import time
from pathlib import Path

import torch

from lmc import CacheConfig, CacheEngine
from lmc.storage.backends.p2p.backend import P2PBackend
from tests.kvutil import make_caches, spec_for
from tests.server.engine_proc import _slots

LAYOUT = "vllm_flash"
GEOMETRY = {"blocks": 64, "block_size": 4, "layers": 4, "heads": 2, "dim": 64}


def _caches(seed: int, zeros: bool = False):
    return make_caches(LAYOUT, dtype=torch.bfloat16, seed=seed, zeros=zeros, **GEOMETRY)


def _tokens(seed: int, n: int) -> list[int]:
    return torch.randint(0, 30000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _wait_dead(pid: int, timeout: float = 10.0) -> None:
    """Until ``pid`` is gone or a zombie (its parent, the test, reaps it)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, IndexError):
            return
        if state in ("Z", "X"):
            return
        time.sleep(0.005)
    raise TimeoutError(f"process {pid} still alive")


class Engine:
    def __init__(self, url: str, workdir: str) -> None:
        self.workdir = Path(workdir)
        # the P2P tier from config alone, as a deployment names it
        cfg = CacheConfig(chunk_size=16, local_cpu_size="32MiB", pin_memory="false",
                          remote_url=url, remote_timeout=2.0,
                          remote_options={"export_ttl": 300.0})
        src = _caches(0)
        self.spec = spec_for(LAYOUT, src)
        self.eng = CacheEngine(cfg, self.spec, model_id="p2p-test")
        self.p2p = self.eng.storage.tiers[-1]
        assert isinstance(self.p2p, P2PBackend), self.eng.storage.tiers
        self.stored: dict[int, list[int]] = {}
        signal.signal(signal.SIGUSR1, self._on_signal)

    def _on_signal(self, *_: object) -> None:
        """Another process's READ is in flight on our chunks: let them all go, reuse memory."""
        for seed, tokens in list(self.stored.items()):
            self.evict(seed, len(tokens))
        (self.workdir / f"evicted.{os.getpid()}").write_text("1")

    def store(self, seed: int, n: int) -> dict:
        tokens = _tokens(seed, n)
        stored = self.eng.store(tokens, _caches(seed), _slots(self.spec, n, seed + 1))
        self.stored[seed] = tokens
        return {"stored": stored, "flushed": self.eng.flush(30),
                "exports": self.p2p.stats()["exports"]}

    def churn(self, seconds: float, seeds: list[int], n: int, rng_seed: int) -> dict:
        """In a background thread for ``seconds``: store a random one of ``seeds`` if absent,
        else evict it (its memory reused by other KV at once), as fast as it goes."""
        def run() -> None:
            rng = random.Random(rng_seed)
            end = time.monotonic() + seconds
            while time.monotonic() < end:
                seed = rng.choice(seeds)
                if seed in self.stored:
                    self.evict(seed, n)
                    self._churned["evicted"] += 1
                else:
                    self.store(seed, n)
                    self._churned["stored"] += 1
        self._churned = {"stored": 0, "evicted": 0}
        self._churner = threading.Thread(target=run, name="churn")
        self._churner.start()
        return {"churning": seconds}

    def churn_wait(self) -> dict:
        self._churner.join()
        return self._churned

    def drop(self, seed: int, n: int) -> dict:
        """Forget the prompt's chunks locally (so the next load asks the peers again)."""
        keys = [k for _, _, k in self.eng.db.process_tokens(_tokens(seed, n))]
        return {"dropped": self.eng.storage.delete(keys)}

    def load(self, seed: int, n: int) -> dict:
        tokens = _tokens(seed, n)
        src, dst = _caches(seed), _caches(seed + 99, zeros=True)
        s_src, s_dst = _slots(self.spec, n, seed + 1), _slots(self.spec, n, seed + 2)
        t0 = time.monotonic()
        hit = self.eng.lookup(tokens)
        got = self.eng.retrieve(tokens, dst, s_dst)
        seconds = time.monotonic() - t0
        # every retrieved token bit-exact; nothing past ``got`` written
        exact = all(torch.equal(s[:, s_src[:got] // 4, s_src[:got] % 4].view(torch.int16),
                                d[:, s_dst[:got] // 4, s_dst[:got] % 4].view(torch.int16))
                    for s, d in zip(src, dst))
        untouched = all(not d[:, s_dst[got:] // 4, s_dst[got:] % 4].view(torch.int16).any()
                        for d in dst)
        return {"lookup": hit, "retrieved": got, "bit_exact": exact, "untouched": untouched,
                "seconds": seconds, "p2p": self.p2p.stats()}

    def evict(self, seed: int, n: int) -> dict:
        tokens = self.stored.pop(seed, _tokens(seed, n))
        keys = [k for _, _, k in self.eng.db.process_tokens(tokens)]
        deleted = self.eng.storage.delete(keys)
        filler = _tokens(seed + 1000, n)  # reuse the freed memory for other KV
        self.eng.store(filler, _caches(seed + 1000), _slots(self.spec, n, seed + 1001))
        return {"deleted": deleted}

    def forget(self, seed: int, n: int) -> dict:
        """Let the prompt's exports go *without* telling the directory (a lost withdraw), then
        evict and reuse the memory: the directory keeps stale records for them."""
        tokens = self.stored.get(seed, _tokens(seed, n))
        keys = [k for _, _, k in self.eng.db.process_tokens(tokens)]
        with self.p2p._lock:
            gone = [t for t in (self.p2p._take(k) for k in keys) if t]
        for _, e in gone:
            e.obj.release()
        out = self.evict(seed, n)
        return {"forgotten": len(gone), **out}

    def arm(self, when: str, action: str, pid: int) -> dict:
        def hook(agent: str) -> None:
            self.p2p.before_read = self.p2p.after_read = None  # once
            if action == "kill":
                os.kill(pid, signal.SIGKILL)
                _wait_dead(pid)
            else:
                flag = self.workdir / f"evicted.{pid}"
                flag.unlink(missing_ok=True)
                os.kill(pid, signal.SIGUSR1)
                end = time.monotonic() + 10
                while not flag.exists() and time.monotonic() < end:
                    time.sleep(0.002)
        setattr(self.p2p, "before_read" if when == "before" else "after_read", hook)
        return {"armed": when}


def _answer(obj: dict) -> None:
    """One answer line, marked: libraries below NIXL may print to stdout too."""
    print("@lmc " + json.dumps(obj), flush=True)


def main() -> None:
    url, workdir = sys.argv[1], sys.argv[2]
    eng = Engine(url, workdir)
    _answer({"pid": os.getpid(), "agent": eng.p2p.agent_name})
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd.pop("op")
        if op == "exit":
            eng.eng.close()
            _answer({"closed": True})
            os._exit(0)
        try:
            out = eng.p2p.stats() if op == "stats" else getattr(eng, op)(**cmd)
        except Exception as e:  # answered, so the test sees it
            out = {"error": f"{type(e).__name__}: {e}"}
        _answer(out)
    os._exit(0)


if __name__ == "__main__":
    main()
