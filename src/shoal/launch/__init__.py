"""Starting clusters; the only code that reads environment variables.

- ``cli``: the ``shoal`` command
- ``local``: ``LocalCluster`` (one machine: rendezvous, servers, workers)
- ``status``: ``shoal status``, and the run files that find running jobs
- ``report``: run reports (plots and an HTML page)
- ``torchrun``: running under ``torchrun``
- ``ray_backend``: running on a Ray cluster
- ``env``: the SHOAL_* environment contract
- ``server_main``: entry point of a server process
- ``lifecycle``: children die with their launcher
- ``forked``: job processes forked from a launcher that loaded Shoal once
- ``warm``: ``shoal warm`` and ``shoal run``'s side of a warm launcher (a launcher kept loaded that forks each job)
- ``warm_server``: the warm launcher itself
- ``user_dir``: the per-user private directory of run files, secrets and the warm launcher's socket
"""
