"""Shard storage on shared memory, update rules and their kernels. Knows nothing of sockets.

- ``segment``: memfd segments and striped row locks
- ``shard``: ``ShardStore`` (values + optimiser state of one shard)
- ``in_place``: a store's rows held for a kernel that updates them where they lie
- ``rules``: Sum, SGD, Adagrad, Adam as update rules
- ``state``: the per-row state each optimiser keeps (what a row weighs, without the kernels)
- ``initialize``: per-key seeded initial values
- ``kernels``: compiled gather / scatter / rule loops
- ``jit``: kernels compiled with numba at their first call, not at import
- ``fences``: the memory fences of a hold letting go of its rows without a lock
- ``validate``: checks on keys and rows that every entry point runs
- ``checkpoint``: checkpoints on disk, by global key, with optimiser state
"""
