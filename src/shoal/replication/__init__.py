"""Replicated shards: multi-master replicas of a SumLattice kept in sync by gossip,
the probabilistic consistency model, and read-quorum choice. Pure: no sockets.

- ``replica``: ``ShardReplica`` (accept pushes, serve reads, absorb gossip)
- ``gossip``: digests and deltas as plain payloads, and the jittered schedule
- ``delays``: propagation and read-latency samples
- ``pbs``: the model (probability a read misses at most k pushes) and ``choose_read_quorum``
- ``bounds``: ``PushCounts``, what a read under BSP/SSP/ESSP must cover, from the workers' clock ticks
- ``eager``: ``Subscribers``, the rows a replica pushes to the workers that read them (ESSP)
"""
