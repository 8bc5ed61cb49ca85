"""The router's fleet with a shared daemon (``--shared-events``): B, which never stored the
prompt, is picked with the daemon's prefix predicted, and the flag's mistakes are named."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
import torch

from lmc.router.dispatch import Fleet, InstanceSpec
from lmc.router.feed import EventFeed, SharedSpec
from tests.kvutil import random_tokens
from tests.router.test_router_shared import CHUNK, EVENTS, instance
from tests.server.daemon_proc import DaemonProc

pytestmark = pytest.mark.integration


def test_the_fleet_predicts_the_shared_prefix_for_an_instance_that_never_stored_it(tmp_path):
    d = DaemonProc(tmp_path / "d", ["--size", "64MiB", "--kv-events", json.dumps(EVENTS)]
                   ).start()
    feed = None
    try:
        ev = d.info["kv_events"]
        with instance(d.url) as (ea, ca, eva):
            fleet = Fleet([InstanceSpec("http://a:1", eva.endpoint, eva.replay_endpoint),
                         InstanceSpec("http://b:1")],
                        shared=[SharedSpec.parse(f"{ev['endpoint']},replay="
                                                 f"{ev['replay_endpoint']}")])
            feed = EventFeed(fleet.sources, 5.0)
            feed.start()
            prompt = random_tokens(4 * CHUNK, seed=9)
            ea.store(prompt, ca, torch.arange(len(prompt)))
            ea.flush()
            end = time.monotonic() + 15
            while time.monotonic() < end:  # until B (the daemon's events) sees it all
                pick = fleet.pick(prompt, None, exclude={"http://a:1"})
                fleet.done(pick.instance)
                if pick.predicted == len(prompt):
                    break
                time.sleep(0.1)
            a = fleet.pick(prompt, None, exclude={"http://b:1"})  # A busy: B gets the next
            b = fleet.pick(prompt, None)
            assert (b.instance.url, b.reason, b.predicted) == ("http://b:1", "prefix",
                                                                len(prompt)), b
            fleet.done(a.instance)
            fleet.done(b.instance)
    finally:
        if feed is not None:
            feed.close()
        d.kill()


def test_a_bad_shared_events_flag_is_named():
    run = subprocess.run([sys.executable, "-c", "import sys, lmc.cli; sys.exit(lmc.cli.main())", "router", "--instance", "http://a:1",
                          "--shared-events", "http://nope"], capture_output=True, text=True,
                         timeout=60)
    assert run.returncode == 2 and "--shared-events" in run.stderr, run.stderr
    assert "Traceback" not in run.stderr
