"""Where keys live. Pure: computes mappings and plans, never sends anything.

- ``mapping``: range, round-robin and hash key -> (shard, row) rules
- ``layout``: ``TableLayout``, a mapping plus shard owners at an epoch
"""
