"""A sparse embedding whose rows live in a Shoal table."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import nn

from shoal.api.errors import DTypeError, ShoalError
from shoal.client.table import Table


def to_torch(array: np.ndarray) -> torch.Tensor:
    """A tensor sharing ``array``'s memory (no copy; writable arrays only)."""
    if not array.flags.writeable:
        array = array.copy()
    return torch.from_numpy(array)


def to_numpy(tensor: torch.Tensor) -> np.ndarray:
    """An array sharing ``tensor``'s memory when it is a contiguous CPU tensor (else a copy)."""
    t = tensor.detach()
    if t.device.type != "cpu" or not t.is_contiguous():
        t = t.cpu().contiguous()
    return t.numpy()


class _Rows(torch.autograd.Function):
    """Pulled rows as a tensor; the gradient of the rows goes back to the table."""

    @staticmethod
    def forward(ctx: Any, anchor: torch.Tensor, keys: torch.Tensor, module: Embedding) -> torch.Tensor:
        ctx.keys, ctx.module = keys, module
        return to_torch(module.table.pull(to_numpy(keys).astype(np.int64, copy=False)))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        ctx.module._gradient(ctx.keys, grad)
        return torch.zeros(()), None, None


class Embedding(nn.Module):
    """Rows of ``table`` as an embedding layer.

    ``push="backward"`` pushes each backward pass's row gradients at its end
    (asynchronously; they are waited for at the next ``forward`` or ``step``);
    ``push="step"`` keeps them until ``step()``, and ``zero_grad()`` (setting
    gradients to None, torch's default) discards them. Duplicate keys, within a
    batch and across the module's uses in one backward pass, are summed by the
    table, whose update rule (``SGD``, ``Adagrad``, ``Adam``) runs once per push
    where the rows live, so no torch optimiser is needed for these rows. Two
    modules on one table push apart: use one module where torch would share one
    weight.
    """

    def __init__(self, table: Table, push: str = "backward") -> None:
        super().__init__()
        if push not in ("backward", "step"):
            raise ValueError(f"push must be 'backward' or 'step', got {push!r}")
        self.table = table
        self.push = push
        # Autograd calls backward only for outputs that depend on a parameter: this one does. Its
        # gradient is accumulated once per backward pass, after every use of the module in it: the
        # hooks on that accumulation mark the pass's end, and a gradient of None (zero_grad) tells
        # that the kept batches were discarded.
        self._anchor = nn.Parameter(torch.zeros(()), requires_grad=True)
        self._anchor.register_hook(self._before_accumulation)
        self._anchor.register_post_accumulate_grad_hook(self._after_backward)
        self._this_pass: list[tuple[np.ndarray, np.ndarray]] = []
        self._pending: list[tuple[np.ndarray, np.ndarray]] = []
        self._in_flight: list[Any] = []

    @property
    def embedding_dim(self) -> int:
        return self.table.dim

    @property
    def num_embeddings(self) -> int:
        return self.table.num_keys

    def forward(self, keys: torch.Tensor) -> torch.Tensor:
        if keys.is_floating_point() or keys.is_complex() or keys.dtype == torch.bool:
            raise DTypeError(f"keys of table {self.table.name!r} must be integers, got dtype {keys.dtype}")
        self._end_pass()  # a pass that did not reach the anchor (torch.autograd.grad of other inputs)
        self._wait()
        flat = keys.reshape(-1)
        rows = _Rows.apply(self._anchor, flat, self)
        return rows.reshape(*keys.shape, self.table.dim)

    def _gradient(self, keys: torch.Tensor, grad: torch.Tensor) -> None:
        k = to_numpy(keys).astype(np.int64, copy=False)
        self._this_pass.append((k, np.ascontiguousarray(to_numpy(grad), dtype=self.table.dtype)))

    def _before_accumulation(self, grad: torch.Tensor) -> None:
        if self._anchor.grad is None:  # zero_grad since the kept batches' backward: they are dropped
            self._pending.clear()

    def _after_backward(self, anchor: torch.Tensor) -> None:
        self._end_pass()

    def _end_pass(self) -> None:
        if not self._this_pass:
            return
        this_pass, self._this_pass = self._this_pass, []
        if self.push == "backward":
            self._in_flight.append(self.table.push_async(*_joined(this_pass)))
        else:
            self._pending.extend(this_pass)

    def step(self) -> None:
        """Push gradients kept since the last step (``push="step"``) and wait for every push."""
        self._end_pass()
        if self._pending and self._anchor.grad is not None:
            self._in_flight.append(self.table.push_async(*_joined(self._pending)))
        self._pending.clear()
        self._wait()

    def _wait(self) -> None:
        """Wait for every push in flight; the first that failed is raised, once."""
        in_flight, self._in_flight = self._in_flight, []
        errors = []
        for f in in_flight:
            try:
                f.wait()
            except ShoalError as exc:
                errors.append(exc)
        if errors:
            raise errors[0]


def _joined(batches: list[tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
    """Several batches' keys and row gradients as one push."""
    if len(batches) == 1:
        return batches[0]
    return np.concatenate([k for k, _ in batches]), np.concatenate([g for _, g in batches])
