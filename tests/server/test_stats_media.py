"""``lmc stats``: each tier's declared medium and capabilities, lookups counted, and an
answer without waiting for torch (issue 21's tier media; issue 26 item 9).

What a daemon says of its tiers comes from the tiers themselves (``lmc.server.views.
tier_media`` reads ``medium`` and ``capabilities``), so a tier added to the chain shows what
it declares with no change here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import torch

from lmc.config import CacheConfig
from lmc.memory.pool import MemoryPool
from lmc.server.stats_cli import format_info
from lmc.server.views import tier_media
from lmc.storage.backends.cpu import CPUBackend
from lmc.storage.backends.disk.backend import DiskBackend
from lmc.storage.backends.server import protocol as P
from lmc.storage.tier import Medium, TierCapabilities
from tests.server import wire
from tests.server.daemon_proc import ROOT


def _lmc_stats(url: str, *extra: str) -> subprocess.CompletedProcess:
    """``lmc stats`` in a fresh interpreter, which also says whether torch got imported."""
    code = ("import sys\nfrom lmc.cli import main\ntry:\n    main(sys.argv[1:])\n"
            "finally:\n    print('@torch', 'torch' in sys.modules)\n")
    return subprocess.run([sys.executable, "-c", code, "stats", "--url", url, *extra],
                          capture_output=True, text=True, timeout=60, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})


def test_tier_media_reads_each_tiers_declaration(tmp_path):
    pool = MemoryPool(1 << 20, pin_memory="false")
    config = CacheConfig(local_cpu_size="1MiB", local_disk=str(tmp_path / "d"),
                         local_disk_size="4MiB")
    cpu = CPUBackend(config=config, pool=pool)
    disk = DiskBackend(config=config, pool=pool)
    try:
        media = tier_media([cpu, disk])
    finally:
        disk.close()
        cpu.close()
        pool.close()
    assert list(media) == [cpu.name, disk.name]
    assert media[disk.name] == {"medium": "local_storage", "layered_reads": True,
                                "existence_without_reading": True, "durable": True}
    assert media[cpu.name]["medium"] == Medium.MEMORY.value
    assert set(media[cpu.name]) == {"medium", *TierCapabilities.__dataclass_fields__}


def _answer(**requests: int) -> dict:
    return {"server": {"uptime_s": 10.0}, "pool": {"capacity": 1 << 26},
            "requests": requests,
            "tiers": {"cpu.capacity": 1 << 26, "cpu.chunks": 4, "cpu.used": 4096,
                      "disk.capacity": 1 << 26, "disk.chunks": 4, "disk.used_bytes": 8192,
                      "disk.get_hits": 1, "disk.get_misses": 1, "disk.lookup_hits": 1,
                      "disk.lookup_misses": 2},
            "media": {"cpu": {"medium": "memory", "layered_reads": False,
                              "existence_without_reading": True, "durable": False},
                      "disk": {"medium": "local_storage", "layered_reads": True,
                               "existence_without_reading": True, "durable": True}}}


def test_each_tier_line_says_its_medium_and_capabilities():
    text = format_info(_answer(gets=1, get_keys=4, hits=3))
    assert "cpu [memory: lookups without reading]: 4 chunks" in text, text
    assert "disk [local_storage: layered reads, lookups without reading, durable]: " in text
    assert "cpu [memory: lookups without reading]: 4 chunks, 4.00 KiB of 64.0 MiB; hits " \
           "50.0% (2/4) read keys;" in text, text
    assert "disk [local_storage: layered reads, lookups without reading, durable]: 4 chunks" \
           ", 8.00 KiB of 64.0 MiB; hits 50.0% (1/2) reads, 33.3% (1/3) lookups;" in text
    older = _answer(gets=1, get_keys=4, hits=3)
    del older["media"]  # a daemon from before the media section: lines as before
    assert "\ncpu: 4 chunks" in format_info(older)


def test_lookups_that_hit_are_counted_not_zero_over_zero():
    text = format_info(_answer(lookups=2, lookup_keys=6, lookup_hits=4))
    assert "lookups: 2, 0.2/s; found 66.7% (4/6) keys" in text, text
    # the memory tier found 3 of the 6 keys looked up (the disk found the 4th)
    assert "hits 50.0% (3/6) looked-up keys" in text, text
    assert "(0/0)" not in text.split("# Tiers")[1]
    idle = format_info(_answer())
    assert "cpu [memory: lookups without reading]: 4 chunks, 4.00 KiB of 64.0 MiB; nothing " \
           "asked yet" in idle, idle


# ---------------------------------------------------------------- against a real daemon
def test_a_daemon_reports_its_tiers_media_and_lookups(start_daemon, tmp_path):
    d = start_daemon("--size", "64MiB", "--disk", str(tmp_path / "disk"), "--disk-size",
                     "64MiB")
    c = wire.RawClient(d.port)
    try:
        assert c.call(wire.hello(client="stats-media"))[0] == P.OK
        keys = [bytes([i]) * 16 for i in range(6)]
        assert c.call(wire.put("ns", [wire.value_bytes("ns", k) for k in keys[:4]]))[0] == P.OK
        status, meta, _ = c.call(wire.frame(P.EXISTS, {"ns": "ns", "keys": keys,
                                                      "prefix": True}))
        assert status == P.OK and meta["hits"] == 4
    finally:
        c.close()
    stats = json.loads(_lmc_stats(d.url, "--json").stdout.split("@torch")[0])
    assert stats["media"]["disk"]["medium"] == "local_storage", stats.get("media")
    assert stats["media"]["cpu"]["medium"] == "memory"
    req = stats["requests"]
    assert (req["lookups"], req["lookup_keys"], req["lookup_hits"]) == (1, 6, 4), req
    text = _lmc_stats(d.url).stdout
    assert "disk [local_storage: layered reads" in text, text
    assert "found 66.7% (4/6) keys" in text and "(4/6) looked-up keys" in text, text


def test_lmc_stats_answers_without_importing_torch(shared_daemon):
    assert torch.__version__  # this process has torch; the command must not need it
    t0 = time.monotonic()
    out = _lmc_stats(shared_daemon.url)
    took = time.monotonic() - t0
    assert out.returncode == 0, out.stderr
    assert "# Tiers" in out.stdout
    assert "@torch False" in out.stdout, f"lmc stats imported torch (took {took:.1f} s)"


# ---------------------------------------------------------------- a coded tier (issue 37)
def test_a_coded_tier_says_its_bytes_before_and_after_the_codec():
    answer = _answer()
    answer["tiers"].update({"disk.codec": "int8.h64", "disk.codec_active": True,
                            "disk.codec_raw_bytes_write": 4 << 20,
                            "disk.codec_stored_bytes_write": 2 << 20,
                            "disk.codec_raw_bytes_read": 1 << 20,
                            "disk.codec_stored_bytes_read": 512 << 10,
                            "disk.codec_corrupt": 1})
    text = format_info(answer)
    assert "\n  codec int8.h64 (on): wrote 4.00 MiB of KV as 2.00 MiB (0.50), read 1.00 MiB " \
           "of KV from 512 KiB (0.50); corrupt 1" in text, text
    answer["tiers"].update({"disk.codec_active": False, "disk.codec_gate": "no verdict"})
    assert "codec int8.h64 (off: no verdict; values stored exact): wrote" in format_info(answer)
    assert "codec" not in format_info(_answer()), "a tier without a codec grew a codec line"


def test_a_daemon_with_a_coded_disk_reports_it_in_stats_and_prometheus(start_daemon, tmp_path):
    """A daemon's ``tiers:`` chain with ``codec:`` on its disk entry: what the daemon
    offloads is coded, and ``lmc stats`` and ``/metrics`` say how many bytes went in and
    were stored."""
    conf = tmp_path / "server.yaml"
    conf.write_text(json.dumps({"cache": {"tiers": [
        "memory", {"backend": "disk", "path": str(tmp_path / "disk"), "capacity": "64MiB",
                   "codec": "int8", "gate": "off"}]}}))
    d = start_daemon("--config", str(conf), "--size", "64MiB")
    c = wire.RawClient(d.port)
    try:
        assert c.call(wire.hello(client="stats-codec"))[0] == P.OK
        keys = [bytes([i]) * 16 for i in range(4)]
        assert c.call(wire.put("ns", [wire.value_bytes("ns", k, tokens=16) for k in keys]))[0] \
            == P.OK
    finally:
        c.close()
    deadline = time.monotonic() + 30
    while True:  # the write-behind to the disk
        tiers = d.stats()["tiers"]
        if tiers.get("disk.codec_raw_bytes_write", 0) == 4 * 2 * 16 * 64 * 2:
            break
        assert time.monotonic() < deadline, f"nothing coded to the disk in 30 s: {tiers}"
        time.sleep(0.05)
    stored = tiers["disk.codec_stored_bytes_write"]
    # less than the fp16 chunks (the wire values' bytes include NaNs, which int8 keeps exact)
    assert 0 < stored < 4 * 2 * 16 * 64 * 2, tiers
    text = _lmc_stats(d.url).stdout
    assert "  codec int8.h0 (on): wrote 16.0 KiB of KV as " in text, text
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{d.info['metrics_port']}/metrics",
                                timeout=10) as r:
        metrics = r.read().decode()
    assert f'lmc_codec_bytes_total{{form="stored",op="write",tier="disk"}} {float(stored)}' \
        in metrics, [m for m in metrics.splitlines() if "codec" in m]
    assert 'lmc_codec_bytes_total{form="raw",op="write",tier="disk"} 16384.0' in metrics
