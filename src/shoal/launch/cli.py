"""The ``shoal`` command.

    shoal run --nodes 2 --workers-per-node 1 -- python train.py
    shoal status --watch 1
    shoal warm start

Only what parsing needs is imported up front: ``shoal run`` asks a warm launcher
(``shoal.launch.warm``) before it loads the launcher's own modules (0.15 s).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence
from typing import NoReturn

from shoal.api.config import Limits, RebalancePolicy, Timeouts
from shoal.api.errors import ClusterError, ShoalError
from shoal.launch import warm


class _Version(argparse.Action):
    """``--version``, looked up only when asked: ``importlib.metadata`` costs every launch 0.05 s."""

    def __call__(self, parser: argparse.ArgumentParser, *args: object) -> None:
        import importlib.metadata

        print(f"shoal {importlib.metadata.version('shoal')}")
        parser.exit()


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="shoal", description="Shoal parameter server")
    parser.add_argument("--version", action=_Version, nargs=0, help="show the version and exit")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run a training script on a local cluster",
                         description="Start a rendezvous, one server per node and the workers on this machine; "
                                     "every worker runs COMMAND.")
    run.add_argument("--nodes", type=int, default=1, help="nodes, one server each (default 1)")
    run.add_argument("--workers-per-node", type=int, default=1, help="workers on each node (default 1)")
    run.add_argument("--transport", choices=("tcp", "ipc"), default="tcp", help="server transport (default tcp)")
    run.add_argument("--host", default="127.0.0.1", help="address servers bind (default 127.0.0.1)")
    run.add_argument("--secret-file", help="file holding the job's secret (hex); default: one made for the job")
    run.add_argument("--classic", action="store_true",
                     help="send every key through a server, also local ones (classic parameter server)")
    run.add_argument("--max-message-bytes", type=int, default=Limits().max_message_bytes,
                     help="largest message in bytes any process of the job accepts; a bigger one is dropped unread "
                          "(default %(default)s)")
    run.add_argument("--connect-timeout", type=float, default=Timeouts().connect_s,
                     help="seconds to wait for peers to appear (default %(default)s)")
    run.add_argument("--request-timeout", type=float, default=Timeouts().request_s,
                     help="seconds to wait for any reply (default %(default)s)")
    run.add_argument("--barrier-timeout", type=float, default=Timeouts().barrier_s,
                     help="seconds a worker waits in ps.barrier() for the others (default %(default)s)")
    run.add_argument("--replica-timeout", type=float, default=Timeouts().replica_s,
                     help="seconds before a silent replica is routed around (default %(default)s)")
    run.add_argument("--resend-timeout", type=float, default=Timeouts().resend_s,
                     help="at most this many seconds before an unanswered request is sent again, sooner once "
                          "its peer's round trips are timed (default %(default)s)")
    run.add_argument("--no-prefix", action="store_true", help="do not prefix output lines with [w<rank>]")
    run.add_argument("--fresh-interpreters", action="store_true",
                     help="start every process as a new interpreter instead of forking the servers and the Python "
                          "workers from the launcher, which loads Shoal once for all of them (0.7 s per process)")
    run.add_argument("--faults", help="inject network faults into every process, e.g. 'delay_ms=2,loss=0.01'")
    run.add_argument("--on-server-failure", choices=("fail", "continue", "restart"), default="fail",
                     help="when a server dies: stop the job (default), go on without it, or start it again")
    run.add_argument("--max-server-restarts", type=int, metavar="N",
                     help="under --on-server-failure restart, start one server again at most N times, each later "
                          "than the one before; its next death stops the job (default 3)")
    run.add_argument("--rebalance", type=float, metavar="MAX_OVER_MEAN",
                     help="move slices between servers when the busiest serves more than this times the mean "
                          "(e.g. 1.25); off by default")
    run.add_argument("--report", metavar="DIR",
                     help="write a run report into DIR: plots of what workers log with ps.log(...), "
                          "throughput, per-server load and read staleness, on one HTML page")
    run.add_argument("--cold", action="store_true",
                     help="start the job from this command even when a warm launcher runs (`shoal warm`)")
    run.add_argument("cmd", nargs=argparse.REMAINDER, help="-- the worker command")
    warm_up = sub.add_parser("warm", help="keep a launcher loaded that starts each `shoal run` without loading "
                                          "Shoal and numba again",
                             description="A background process of this user that keeps Shoal, numba and the row "
                                         "kernels loaded; `shoal run` (same environment, same Shoal) forks its "
                                         "jobs from it instead of loading them (about 0.4 s of every job).")
    warm_up.add_argument("action", choices=("start", "stop", "status", "serve"),
                         help="start one in the background, stop it once its jobs end, say how it is, or be one "
                              "(in the foreground: what start runs)")
    warm_up.add_argument("--idle-minutes", type=float, default=30.0,
                         help="exit after this long without a job (default %(default)s)")
    status = sub.add_parser("status", help="print a table of a running cluster",
                            description="Ask the rendezvous and every server of a running cluster how they are. "
                                        "Names a job `shoal run` started on this machine by its cluster id (which "
                                        "`shoal run` prints when it starts); without one, the only job running, "
                                        "or a list of the running jobs when there are several.")
    status.add_argument("cluster_id", nargs="?", help="the job's cluster id, or a unique start of it")
    status.add_argument("--rendezvous", help="the rendezvous address, e.g. tcp://10.0.0.1:29400")
    status.add_argument("--secret-file", help="the job's secret (default: the one `shoal run` made for it)")
    status.add_argument("--watch", type=float, metavar="SECONDS", help="refresh every SECONDS (with rates)")
    status.add_argument("--count", type=int, default=None, help="tables to print (default 1, or 3600 with --watch)")
    token = sub.add_parser("metrics-token", help="print the bearer token that scrapes a job's metrics",
                           description="Prometheus presents it (bearer_token_file) to every server and worker "
                                       "of the job; it is derived from the job's secret, which it does not reveal.")
    token.add_argument("cluster_id", nargs="?", help="a job `shoal run` started here (default: the only one)")
    token.add_argument("--secret-file", help="the job's secret (default: SHOAL_SECRET, SHOAL_SECRET_FILE, or "
                                             "the one `shoal run` made for the job)")
    return parser


def _metrics_token(args: argparse.Namespace) -> int:
    from shoal.cluster.metrics import metrics_token
    from shoal.launch.env import read_secret
    from shoal.launch.status import find_job

    secret = read_secret({"SHOAL_SECRET_FILE": args.secret_file} if args.secret_file else dict(os.environ))
    if secret is None:
        try:
            job = find_job(args.cluster_id)
        except ClusterError as exc:
            print(f"shoal metrics-token: no secret given (--secret-file, SHOAL_SECRET or SHOAL_SECRET_FILE) "
                  f"and {exc}", file=sys.stderr)
            return 1
        secret = read_secret({"SHOAL_SECRET_FILE": job.get("secret_file") or ""})
        if secret is None:
            print(f"shoal metrics-token: job {job['cluster_id']} left no secret file; give --secret-file",
                  file=sys.stderr)
            return 1
    print(metrics_token(secret))
    return 0


def _status(args: argparse.Namespace) -> int:
    from shoal.launch.env import read_secret
    from shoal.launch.status import find_job, watch

    rendezvous = args.rendezvous or (None if args.cluster_id else os.environ.get("SHOAL_RENDEZVOUS"))
    secret_file = args.secret_file
    if not rendezvous:
        try:
            job = find_job(args.cluster_id)
        except ClusterError as exc:
            print(f"shoal status: {exc}", file=sys.stderr)
            return 1
        rendezvous, secret_file = job["rendezvous"], secret_file or job.get("secret_file")
    secret = read_secret({"SHOAL_SECRET_FILE": secret_file} if secret_file else dict(os.environ))
    if secret is None:
        print("shoal status: give the job's secret (--secret-file, SHOAL_SECRET or SHOAL_SECRET_FILE)",
              file=sys.stderr)
        return 1
    count = args.count if args.count is not None else (3600 if args.watch else 1)
    watch(rendezvous, secret, args.watch or 1.0, count, sys.stdout)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "warm":
        if args.action == "serve":
            from shoal.launch.warm_server import serve

            return serve(args.idle_minutes, main)
        return warm.command(args.action, args.idle_minutes)
    from shoal.launch.env import read_secret
    from shoal.launch.lifecycle import keep_startup_objects
    from shoal.launch.local import LaunchOptions, LocalCluster

    logging.basicConfig(level=logging.WARNING, format="shoal: %(levelname)s %(message)s")
    keep_startup_objects()
    if args.command in ("status", "metrics-token"):
        try:
            return _status(args) if args.command == "status" else _metrics_token(args)
        except ShoalError as exc:
            print(f"shoal {args.command}: {exc}", file=sys.stderr)
            return 2
    command = list(args.cmd)
    if command and command[0] == "--":
        command = command[1:]
    try:
        secret = read_secret({"SHOAL_SECRET_FILE": args.secret_file} if args.secret_file else {})
        options = LaunchOptions(
            command=command, nodes=args.nodes, workers_per_node=args.workers_per_node, host=args.host,
            transport=args.transport, secret=secret, local_access=not args.classic,
            limits=Limits(args.max_message_bytes),
            timeouts=Timeouts(args.connect_timeout, args.request_timeout, args.barrier_timeout, args.replica_timeout,
                              args.resend_timeout),
            prefix_output=not args.no_prefix, on_server_failure=args.on_server_failure,
            **({} if args.max_server_restarts is None else {"max_server_restarts": args.max_server_restarts}),
            extra_env={"SHOAL_FAULTS": args.faults} if args.faults else {},
            rebalance=RebalancePolicy(threshold=args.rebalance) if args.rebalance else None,
            report=args.report, fork_from_launcher=not args.fresh_interpreters,
        )
        return LocalCluster(options).run()
    except ShoalError as exc:
        print(f"shoal: {exc}", file=sys.stderr)
        return 2


def console() -> NoReturn:
    """The ``shoal`` command: ``main``, then exit without the interpreter's teardown. When ``main``
    returns, what a job made is gone (its processes reaped, its files removed, its sockets closed);
    what is left is the launcher's preload (numba, LLVM, the kernels), which the teardown would take
    apart object by object, 30 ms of every job's end here."""
    status = _main_or_warm()
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe or stream: nothing more can reach it
            pass
    os._exit(status)


def _main_or_warm() -> int:
    """``main``; a ``shoal run`` goes to a warm launcher first, where one runs for this environment."""
    argv = sys.argv[1:]
    args = _parser().parse_args(argv)
    if args.command == "run" and not args.cold:
        status = warm.run(argv)
        if status is not None:
            return status
    return main(argv)


if __name__ == "__main__":
    console()
