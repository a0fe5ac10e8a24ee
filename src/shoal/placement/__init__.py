"""Where keys live. Pure: computes mappings and plans, never sends anything.

- ``mapping``: range, round-robin and hash key -> (shard, row) rules
- ``layout``: ``TableLayout``, a mapping plus shard owners at an epoch
- ``kernels``: compiled key routing, one pass over a batch
- ``rebalance``: planning slice moves so that servers carry similar load
- ``ownership``: who owns a key of an adaptive table, as each party knows it
- ``intent``: intent signals and the actions they turn into
"""
