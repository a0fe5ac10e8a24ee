"""Where keys live. Pure: computes mappings, plans and decisions, never sends anything.

- ``mapping``: range, round-robin and hash key -> (shard, row) rules
- ``layout``: ``TableLayout``, a mapping plus shard owners at an epoch
- ``kernels``: compiled key routing, one pass over a batch
- ``rebalance``: planning slice moves so that servers carry similar load
- ``ownership``: who owns a key of an adaptive table, as each party knows it
- ``intent``: intent signals and the actions they turn into
- ``adaptive_table``: one node's state of an adaptive table, and the effects decisions produce
- ``held``: worker requests served from the rows here or held for rows on their way here
- ``messages``: the typed messages between nodes about an adaptive table's keys, one class per kind
- ``machine``: ``PlacementMachine``, relocation, replicas and intents as events in, messages out
"""
