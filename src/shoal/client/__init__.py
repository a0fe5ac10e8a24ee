"""The worker side: the cluster handle and table handles.

A call goes ``Table`` (checks the input) -> the table's ``TableAccess``, picked
once by its kind -> local rows in shared memory, or requests to servers.

- ``worker``: ``Worker`` (join, create tables, clock, barrier, checkpoints, shutdown)
- ``table``: ``Table``, the front door of every kind of table
- ``dense``: ``DenseTable``, a weight tensor kept as rows
- ``context``: ``WorkerContext`` and ``TableView``, what the parts below see of a worker and a table
- ``access``: ``TableAccess``, what differs between kinds of table
- ``static``: ``StaticAccess``, slices at one server each until moved, this node's in shared memory
- ``lane``: ``WorkerLane``, small static pulls sent and answered whole in compiled code
- ``routed``: ``RoutedAccess``, the one way static and adaptive tables follow keys answered "moved"
- ``calls``: one call of a table whose keys can move: its parts in flight, and those to send again
- ``fences``: confirming a slice move to the server that fenced it
- ``process_cache``: remote rows of a static table, holding this worker's own pushes
- ``streams``: this worker's requests to each server, numbered so they are handled in order
- ``ticks``: when a worker whose tables are all ASP tells servers its clock
- ``replicated``: ``ReplicatedAccess``, write and read quorums, failover, read-your-writes
- ``replica_view``: which servers this worker believes alive
- ``replica_cache``: under ESSP, replicated rows kept current by the replicas they were read from
- ``adaptive``: ``AdaptiveAccess``, rows that move and replicate, intents
- ``in_place``: ``InPlace``, a kernel's zero-copy hold on this node's rows of a table
- ``sampling``: drawing keys from a distribution and getting their rows (NuPS schemes)
- ``checkpoints``: collective checkpoint and restore
- ``metrics``: what a worker exposes to Prometheus
"""
