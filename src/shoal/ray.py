"""Shoal on a Ray cluster (``pip install 'shoal[ray]'``).

    import ray, shoal, shoal.ray

    def train(epochs):
        ps = shoal.init()          # joins the cluster the backend made
        ...
        ps.shutdown()
        return loss

    ray.init()                     # or an existing cluster: ray.init(address="auto")
    losses = shoal.ray.run(train, nodes=2, workers_per_node=2, args=(10,),
                           worker_resources={"CPU": 2}, server_resources={"CPU": 1})

Each node is packed onto one machine (a Ray placement group); parameter
traffic goes over Shoal's transport, authenticated with a per-job secret.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from shoal.api.errors import ClusterError
from shoal.launch import ray_backend
from shoal.launch.ray_backend import RayJobOptions


def run(fn: Callable[..., Any], *, nodes: int = 1, workers_per_node: int = 1, args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None, **options: Any) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` as every worker; returns each worker's result, by rank.

    ``options`` are the fields of :class:`RayJobOptions` (``server_resources``,
    ``worker_resources``, ``local_access``, ``timeouts``, ``job_timeout_s``, ...).
    """
    job = RayJobOptions(nodes=nodes, workers_per_node=workers_per_node, **options)
    return ray_backend.run(fn, job, args, kwargs)


def run_script(path: str, argv: Sequence[str] = (), *, nodes: int = 1, workers_per_node: int = 1,
               **options: Any) -> None:
    """Run a training script (as ``shoal run`` would) on every worker; raises if one exits non-zero."""
    codes = run(ray_backend.run_script, nodes=nodes, workers_per_node=workers_per_node,
                args=(os.path.abspath(path), list(argv)), **options)
    failed = {rank: code for rank, code in enumerate(codes) if code != 0}
    if failed:
        raise ClusterError(f"{path}: workers exited with non-zero status {failed}")


__all__ = ["RayJobOptions", "run", "run_script"]
