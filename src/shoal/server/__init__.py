"""The server process's logic: a request loop over the shards a node owns.

- ``server``: ``ParameterServer`` (decode, check, dispatch, reply)
- ``tables``: ``ServedTable`` (key-level pull/push over local shard stores)
"""
