"""Frames between endpoints; knows nothing of what messages mean.

- ``base``: the contract (``Transport``, ``Listener``, ``Connection``, ``Poller``)
- ``zmq_transport``: ZeroMQ over tcp and ipc
- ``native``: ZeroMQ sockets that compiled code sends and receives on itself
- ``inproc``: queues in one process, for unit tests
- ``faulty``: a wrapper that delays, drops, duplicates and reorders what arrives
"""

from shoal.transport.base import Connection, Listener, Poller, Transport

__all__ = ["Connection", "Listener", "Poller", "Transport"]
