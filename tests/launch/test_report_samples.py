"""What the launcher keeps of the servers' samples for the run report (no plots: no matplotlib needed)."""

from __future__ import annotations

import json
import time

from shoal.launch import report
from shoal.launch.report import LoadSampler
from shoal.transport.zmq_transport import ZmqTransport
from tests.support.cluster import ThreadCluster


def test_the_launcher_keeps_a_bounded_number_of_samples_over_the_whole_job(tmp_path, monkeypatch):
    # A sample every 10 ms and room for 20: the whole second and a half is kept, at a coarser step.
    monkeypatch.setattr(report, "SAMPLE_S", 0.01)
    monkeypatch.setattr(report, "MAX_SAMPLES", 20)
    with ThreadCluster(nodes=1, transport=ZmqTransport()) as c:
        sampler = LoadSampler(c.rendezvous.address, None, tmp_path)
        began = time.monotonic()
        # At least 1.5 s, and until the samples were thinned (a busy machine answers fewer a second).
        while time.monotonic() - began < 1.5 or (sampler.period_s == 0.01 and time.monotonic() - began < 30):
            time.sleep(0.05)
        sampler.stop()
    kept = json.loads((tmp_path / "servers.json").read_text())
    times = [s["t"] for s in kept["samples"]]
    assert 10 <= len(times) <= 20, times
    assert times == sorted(times) and times[0] < 0.5 and times[-1] > 1.2, times  # from the start to the end
    assert kept["interval_s"] > 0.01 and all(s["servers"] for s in kept["samples"])
