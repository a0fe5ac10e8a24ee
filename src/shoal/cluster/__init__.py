"""Finding peers and talking to them: rendezvous, membership, barriers, request tracking.

- ``requests``: ``RequestTracker`` (requests in flight, matched to replies) and ``Future``
- ``rendezvous``: the ``Rendezvous`` service
- ``membership``: register, wait for servers, barrier, leave
- ``fdshare``: passing shared-memory descriptors to co-located processes
"""
