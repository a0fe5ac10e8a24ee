"""The worker side: the cluster handle and table handles.

- ``worker``: ``Worker`` (join, create tables, clock, barrier, shutdown)
- ``table``: ``Table`` (pull / push / push_pull, local rows in shared memory, remote rows batched per node)
"""
