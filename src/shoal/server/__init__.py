"""The server process's logic: a request loop over the shards a node owns.

- ``server``: ``ParameterServer`` (decode, check, dispatch, reply)
- ``service``: ``TableService``, what the loop and checkpoints ask of each kind of table
- ``builds``: tables allocated and initialised off the request loop
- ``peers``: ``PeerDirectory``, the other servers: one tracker and address book for the services
- ``static``: ``StaticService``, the static tables: pulls held by the bound, pushes into the slices
- ``lane``: ``ServerLane``, small static pulls served whole in compiled code, beside the loop
- ``tables``: ``ServedTable`` (key-level pull/push over local shard stores)
- ``streams``: each worker's requests handled in the order it sent them
- ``sync``: worker clocks, held pulls and eager pushes
- ``slicing``: moving slices of static tables between servers while training runs
- ``replicated``: replicas of replicated tables' shards, and gossip
- ``adaptive``: adaptive tables: keys that relocate, hot keys that replicate
- ``checkpoints``: writing this server's rows into a checkpoint, loading them from one
- ``metrics``: what a server exposes to Prometheus
"""
