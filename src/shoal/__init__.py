"""Shoal: a parameter server for distributed machine learning.

    import shoal
    ps = shoal.init()   # inside a script started by `shoal run`
    emb = ps.table("entity", num_keys=200_000, dim=100, init=shoal.Normal(std=0.01),
                   optimizer=shoal.optim.Adagrad(lr=0.1), consistency=shoal.SSP(staleness=2))
    rows = emb.pull(keys)
    emb.push(keys, grads)
    ps.advance_clock()
    ps.shutdown()
"""

from __future__ import annotations

import importlib
import logging
from typing import TYPE_CHECKING, Any

from shoal.api import optim
from shoal.api.config import ClusterSpec, Limits, TableSpec, Timeouts
from shoal.api.consistency import ASP, BSP, ESSP, SSP, LazyPull
from shoal.api.errors import (
    AuthError,
    BudgetError,
    CheckpointError,
    ClosedError,
    ClusterError,
    ConfigError,
    DTypeError,
    KeyRangeError,
    MessageTooLargeError,
    NonFiniteError,
    ProtocolError,
    ReplayError,
    RequestTimeoutError,
    RoleError,
    ServerError,
    ShapeError,
    ShoalError,
    SliceMovedError,
    TableError,
    WriteQuorumError,
)
from shoal.api.initializers import Constant, Normal, Uniform
from shoal.api.replication import Dynamic

if TYPE_CHECKING:
    from shoal.client.in_place import InPlace
    from shoal.client.table import Table
    from shoal.client.worker import Worker
    from shoal.cluster.requests import Future
    from shoal.wire.schema import BarrierNote

logging.getLogger(__name__).addHandler(logging.NullHandler())

#: names imported on first use: they bring the worker (and numba's kernels), which the launcher,
#: the servers' start and ``shoal status`` do without
_LAZY = {"Table": "shoal.client.table", "Worker": "shoal.client.worker", "Future": "shoal.cluster.requests",
         "InPlace": "shoal.client.in_place", "BarrierNote": "shoal.wire.schema"}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'shoal' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value

__version__ = "0.1.0"


def init(local_access: bool | None = None) -> Worker:
    """Join the cluster this process was started in: by ``shoal run``, by ``torchrun``
    (see ``shoal.launch.torchrun``), or by anything that sets the ``SHOAL_*`` variables."""
    from shoal.client.worker import Worker
    from shoal.launch import env, torchrun
    from shoal.launch.lifecycle import bind_to_launcher, keep_large_buffers, keep_startup_objects

    if not env.configured() and torchrun.detected():
        role = torchrun.role()
        torchrun.start_node_services(role)
    else:
        role = env.role_from_env(server=False)
    bind_to_launcher(env.launcher_pid())
    keep_large_buffers()
    keep_startup_objects()
    return Worker(role.cluster, role.rank, role.node, env.transport(),
                  local_access=role.local_access if local_access is None else local_access, owns_transport=True,
                  metrics_port=env.metrics_port(role.node, role.rank), run_dir=env.run_dir(),
                  metrics_host=env.metrics_host())


__all__ = [
    "ASP", "BSP", "Dynamic", "ESSP", "LazyPull", "SSP",
    "AuthError", "BarrierNote", "BudgetError", "CheckpointError", "ClosedError", "ClusterError", "ClusterSpec",
    "ConfigError", "Constant", "DTypeError", "Future", "InPlace", "KeyRangeError", "Limits", "MessageTooLargeError",
    "NonFiniteError", "Normal", "ProtocolError", "ReplayError", "RequestTimeoutError", "RoleError", "ServerError",
    "ShapeError", "ShoalError", "SliceMovedError", "Table", "TableError", "TableSpec", "Timeouts", "Uniform", "Worker",
    "WriteQuorumError", "init", "optim",
]
