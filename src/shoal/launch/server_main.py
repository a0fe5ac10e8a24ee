"""Entry point of a server process: ``python -m shoal.launch.server_main``."""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from types import FrameType

from shoal.api.errors import ShoalError
from shoal.cluster.rendezvous import Rendezvous
from shoal.launch import env
from shoal.launch.lifecycle import bind_to_launcher, keep_large_buffers, keep_startup_objects
from shoal.server.server import ParameterServer
from shoal.wire.codec import Codec


def _watch(pid: int, server: ParameterServer) -> None:
    """Stop the server once ``pid`` (the agent that started this node) is gone."""
    while True:
        time.sleep(1.0)
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            server.stop()
            return


def main() -> int:
    logging.basicConfig(level=env.log_level(), stream=sys.stderr,
                        format="%(levelname)s %(name)s: %(message)s")
    bind_to_launcher(env.launcher_pid())
    keep_large_buffers()
    keep_startup_objects()
    rendezvous: Rendezvous | None = None
    try:
        role = env.role_from_env(server=True)
        transport = env.transport()
        if env.hosts_rendezvous():  # under torchrun, node 0's server is where peers meet
            cluster = role.cluster
            rendezvous = Rendezvous(transport, Codec(cluster.limits, cluster.secret), cluster.rendezvous,
                                    cluster.cluster_id, cluster.num_nodes, cluster.num_workers,
                                    rebalance=env.rebalance()).start()
        server = ParameterServer(role.node, role.cluster, transport, bind=role.bind,
                                 metrics_port=env.metrics_port(role.node, None), metrics_host=env.metrics_host(),
                                 lane=True)
    except ShoalError as exc:
        print(f"shoal server: {exc}", file=sys.stderr)
        return 2

    def stop(signum: int, frame: FrameType | None) -> None:
        server.stop()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    watched = env.watch_pid()
    if watched is not None:
        threading.Thread(target=_watch, args=(watched, server), daemon=True).start()
    try:
        server.run()
    except ShoalError as exc:
        print(f"shoal server {role.node}: {exc}", file=sys.stderr)
        return 1
    finally:
        if rendezvous is not None:
            rendezvous.linger(role.node, timeout_s=2 * rendezvous.dead_after_s)
            rendezvous.stop()
        transport.close()
        owned = env.owned_secret_file()
        if owned is not None:
            owned.unlink(missing_ok=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
