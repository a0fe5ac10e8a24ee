"""What a worker exposes to Prometheus, built at scrape time from its counters."""

from __future__ import annotations

import numpy as np

from shoal.client.context import WorkerContext
from shoal.cluster.metrics import Family, counters


def worker_families(worker: WorkerContext) -> list[Family]:
    tracker = worker.tracker
    families = [
        counters("shoal_worker_requests_total", "Requests and one-way messages sent, by op.", dict(tracker.sent),
                 "op"),
        tracker.latency.family("shoal_worker_request_seconds", "Time from sending a request to its reply.", "op"),
        Family("shoal_worker_bytes_total", "counter", "Bytes sent to and received from servers.")
        .add(tracker.bytes_sent, direction="out").add(tracker.bytes_received, direction="in"),
        Family("shoal_worker_clock", "gauge", "Iterations this worker has finished.").add(worker.clock),
        Family("shoal_worker_requests_resent_total", "counter",
               "Requests sent again because no reply came in time.").add(tracker.resent),
    ]
    resend_after = Family("shoal_worker_resend_timeout_seconds", "gauge",
                          "Per peer (a server, or -1 for the rendezvous): how long an unanswered request waits "
                          "before it is sent again, from the smoothed round trip of its replies.")
    if tracker.resend_s is not None:
        for peer, trip in sorted(tracker.round_trips.items()):
            resend_after.add(trip.timeout(tracker.resend_s), peer=str(peer))
    families.append(resend_after)
    events = Family("shoal_worker_table_events_total", "counter",
                    "Per table: rows served locally or from cache, retries, failovers, samples.")
    staleness = Family("shoal_worker_read_staleness_clocks", "histogram",
                       "Clocks between a read and the clock its rows were current at.")
    for name, table in list(worker.tables.items()):
        for event, count in sorted(dict(table.counters).items()):
            events.add(count, table=name, event=event)
        counts = table.staleness.counts.copy()
        cumulative = np.cumsum(counts)
        total = float(cumulative[-1])
        if total:
            bounds = [(float(b), float(cumulative[b])) for b in (0, 1, 2, 4, 8, 16, 32, 64, 128)]
            bounds.append((float("inf"), total))
            weighted = float((counts * np.arange(counts.shape[0])).sum())
            staleness.histograms.append(({"table": name}, bounds, weighted, total))
    return [*families, events, staleness]
