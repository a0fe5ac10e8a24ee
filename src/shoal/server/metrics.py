"""What a server exposes to Prometheus, built at scrape time from its counters and state."""

from __future__ import annotations

from collections import Counter
from typing import Protocol

from shoal.cluster.metrics import CpuAccount, Family, LatencyHistogram, counters
from shoal.consistency.clocks import FINISHED, ClockTable
from shoal.placement.messages import KINDS
from shoal.server.adaptive import AdaptiveService
from shoal.server.replicated import ReplicationService
from shoal.server.slicing import SliceService
from shoal.server.sync import Synchroniser
from shoal.server.tables import ServedTable


class Measured(Protocol):
    """What the metrics read of a server (``ParameterServer``)."""

    stats: Counter[str]
    clocks: ClockTable
    latency: LatencyHistogram
    cpu: CpuAccount
    queue_length: int
    tables: dict[str, ServedTable]
    sync: Synchroniser
    replication: ReplicationService
    adaptive: AdaptiveService
    slicing: SliceService

#: counters with a family of their own; every other one goes to shoal_server_events_total
_REJECTED = {"dropped_unauthenticated": "unauthenticated", "rejected_malformed": "malformed"}
_RELOCATIONS = {"keys_relocated_here": "here", "keys_relocated_away": "away"}
_SLICES = {"slices_sent": "sent", "slices_received": "received", "slice_moves_failed": "failed"}
#: the placement messages sent to other servers, by kind: a family each for the messages, their keys and
#: their arrays' bytes (counter name -> kind)
_PLACEMENT_SENT = {
    ("shoal_server_placement_messages_sent_total", "Placement messages sent to other servers, by kind (one "
     "PLACEMENT message between two servers carries one or more)."): {f"placement_{kind}_sent": kind for kind in KINDS},
    ("shoal_server_placement_keys_sent_total", "Keys the placement messages sent to other servers were about, "
     "by kind."): {f"placement_{kind}_keys_sent": kind for kind in KINDS},
    ("shoal_server_placement_bytes_sent_total", "Bytes of the arrays (rows, mostly) in the placement messages "
     "sent to other servers, by kind."): {f"placement_{kind}_bytes_sent": kind for kind in KINDS},
}
_OWN = {"messages", "bytes_in", "bytes_out", "rows_cpu_us", *_REJECTED, *_RELOCATIONS, *_SLICES,
        *(name for names in _PLACEMENT_SENT.values() for name in names)}


def server_families(server: Measured) -> list[Family]:
    stats = dict(server.stats)  # one copy: the loop thread keeps counting meanwhile
    for service in (server.sync, server.replication, server.adaptive, server.slicing):
        for key, value in dict(service.stats).items():
            stats[key] = stats.get(key, 0) + value
    ops = {k[3:]: v for k, v in stats.items() if k.startswith("op_")}
    errors = {k[6:]: v for k, v in stats.items() if k.startswith("error_")}
    events = {k: v for k, v in stats.items() if k not in _OWN and not k.startswith(("op_", "error_"))}
    clocks = server.clocks.clocks
    running = clocks[clocks < FINISHED]  # workers that left count as finished, not as fastest
    families = [
        counters("shoal_server_requests_total", "Messages served, by op.", ops, "op"),
        server.latency.family("shoal_server_request_seconds", "Time to serve a message (held pulls: until held).",
                              "op"),
        server.cpu.family("shoal_server_cpu_seconds_total", "The request loop's CPU time: handling each op's "
                          "messages, and each timer.", "activity"),
        server.adaptive.cpu.family("shoal_server_placement_cpu_seconds_total", "The part of PLACEMENT "
                                   "messages' CPU time each kind of placement message took.", "kind"),
        server.adaptive.passes.family("shoal_server_adaptive_pass_cpu_seconds_total", "The adaptive timer's CPU "
                                      "time, by whether a pass sent placement messages or found nothing due.",
                                      "outcome"),
        Family("shoal_server_bytes_total", "counter", "Bytes received and sent.")
        .add(stats.get("bytes_in", 0), direction="in").add(stats.get("bytes_out", 0), direction="out"),
        counters("shoal_server_errors_total", "Requests answered with an error, by error code.", errors, "code"),
        counters("shoal_server_rejected_messages_total", "Messages dropped or rejected before serving.",
                 {r: stats.get(k, 0) for k, r in _REJECTED.items()}, "reason"),
        counters("shoal_server_relocated_keys_total", "Keys of adaptive tables relocated, by direction.",
                 {d: stats.get(k, 0) for k, d in _RELOCATIONS.items()}, "direction"),
        counters("shoal_server_slice_moves_total", "Slices handed over or taken in.",
                 {d: stats.get(k, 0) for k, d in _SLICES.items()}, "outcome"),
        *(counters(family, text, {kind: stats.get(name, 0) for name, kind in names.items()}, "kind")
          for (family, text), names in _PLACEMENT_SENT.items()),
        Family("shoal_server_placement_rows_cpu_seconds_total", "counter", "CPU time adaptive placement spent "
               "copying rows in and out of the store (the store held meanwhile).")
        .add(stats.get("rows_cpu_us", 0) / 1e6),
        counters("shoal_server_events_total", "Other events counted by the server.", events, "event"),
        Family("shoal_server_queue_length", "gauge", "Most messages handled in one burst lately.")
        .add(server.queue_length),
        Family("shoal_server_held_requests", "gauge", "Pulls held until their staleness bound is met.")
        .add(server.sync.held_count()),
        Family("shoal_server_clock", "gauge", "Slowest and fastest worker clock this server knows.")
        .add(int(running.min(initial=0)), bound="slowest")
        .add(int(running.max(initial=0)), bound="fastest"),
    ]
    rows = Family("shoal_server_rows", "gauge", "Rows held, by table.")
    for name, table in list(server.tables.items()):
        rows.add(sum(s.num_rows for s in list(table.stores.values())), table=name)
    families.append(rows)
    lag = Family("shoal_server_replica_lag_seconds", "gauge",
                 "Delay before updates from another replica arrive here (quantiles of recent updates).")
    for name, replicated in list(server.replication.tables.items()):
        for shard, replica in list(replicated.replicas.items()):
            for origin, samples in list(replica.delays.items()):
                if len(samples):
                    for q in (0.5, 0.99):
                        lag.add(samples.quantile(q), table=name, shard=shard, origin=origin, quantile=str(q))
    families.append(lag)
    return families
