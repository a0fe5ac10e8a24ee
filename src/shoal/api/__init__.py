"""Typed settings, specs and the error hierarchy: the bottom layer.

- ``errors``: ``ShoalError`` and its subclasses
- ``ids``: the id spaces of senders and replica origins, and the helpers that compute them
- ``config``: ``TableSpec``, ``ClusterSpec``, ``Limits``, ``Timeouts``
- ``consistency``: ``ASP``, ``BSP``, ``SSP``, ``ESSP``, ``LazyPull``
- ``replication``: read quorums, fixed or ``Dynamic``
- ``initializers``: ``Constant``, ``Uniform``, ``Normal``
- ``optim``: ``Sum``, ``SGD``, ``Adagrad``, ``Adam``
"""
