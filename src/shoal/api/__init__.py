"""Typed settings, specs and the error hierarchy: the bottom layer.

- ``errors``: ``ShoalError`` and its subclasses
- ``config``: ``TableSpec``, ``ClusterSpec``, ``Limits``, ``Timeouts``
- ``initializers``: ``Constant``, ``Uniform``, ``Normal``
- ``optim``: ``Sum``, ``SGD``, ``Adagrad``, ``Adam``
"""
