"""Starting clusters; the only code that reads environment variables.

- ``cli``: the ``shoal`` command
- ``local``: ``LocalCluster`` (one machine: rendezvous, servers, workers)
- ``env``: the SHOAL_* environment contract
- ``server_main``: entry point of a server process
- ``lifecycle``: children die with their launcher
"""
