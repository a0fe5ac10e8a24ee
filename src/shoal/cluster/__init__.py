"""Finding peers and talking to them: rendezvous, membership, barriers, request tracking.

- ``requests``: ``RequestTracker`` (requests in flight, matched to replies, sent again) and ``Future``
- ``replay``: exactly-once serving of requests that arrive more than once, replayed ones refused
- ``links``: numbered one-way channels between servers, kept until acknowledged and passed on in order
- ``roles``: who may ask for what (workers, servers, observers, operators)
- ``rendezvous``: the ``Rendezvous`` service
- ``membership``: register, wait for servers, barrier, leave
- ``slices``: ``SliceAuthority``, where each slice of each static table lives, and moves
- ``liveness``: knowing at once that a process on this machine has ended
- ``fdshare``: passing shared-memory descriptors to co-located processes
- ``metrics``: Prometheus families built from the counters each loop keeps
- ``metrics_endpoint``: a process's metrics port, bound at start; HTTP loaded at the first scrape
- ``exposition``: the families served through ``prometheus_client``
- ``throttle``: warnings that may come in floods, logged once per interval with their count
"""
