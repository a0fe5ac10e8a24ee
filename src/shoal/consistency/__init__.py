"""Consistency as pure decisions: clocks in, serve / hold / release out. No sockets, no threads.

- ``clocks``: ``ClockTable``, the worker clocks one server has learned
- ``reached``: ``ReachedClocks``, the clocks a node's workers reached, as they wrote them beside it
- ``controller``: ``ShardController``, when a pull may be answered (bounds, lazy pull buffer)
- ``schemes``: ``SliceSchemes``, the model a reader holds each slice of a table to
- ``cache``: ``RowCache``, a worker's process cache of remote rows with versions
- ``staleness``: ``StalenessHistogram``
"""
