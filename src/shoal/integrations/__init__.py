"""Integrations with other frameworks; each imports its framework, nothing else does.

- ``torch``: ``Embedding``, ``DenseSync`` and zero-copy tensor views
"""
