"""Entry point of a server process: ``python -m shoal.launch.server_main``."""

from __future__ import annotations

import logging
import signal
import sys
from types import FrameType

from shoal.api.errors import ShoalError
from shoal.launch import env
from shoal.launch.lifecycle import bind_to_launcher, keep_large_buffers
from shoal.server.server import ParameterServer
from shoal.transport.zmq_transport import ZmqTransport


def main() -> int:
    logging.basicConfig(level=env.log_level(), stream=sys.stderr,
                        format="%(levelname)s %(name)s: %(message)s")
    bind_to_launcher(env.launcher_pid())
    keep_large_buffers()
    try:
        role = env.role_from_env(server=True)
        transport = ZmqTransport()
        server = ParameterServer(role.node, role.cluster, transport, bind=role.bind)
    except ShoalError as exc:
        print(f"shoal server: {exc}", file=sys.stderr)
        return 2

    def stop(signum: int, frame: FrameType | None) -> None:
        server.stop()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    try:
        server.run()
    except ShoalError as exc:
        print(f"shoal server {role.node}: {exc}", file=sys.stderr)
        return 1
    finally:
        transport.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
