"""PyTorch integration: the only code in Shoal that imports torch.

- ``Embedding``: an ``nn.Module`` whose rows live in a Shoal table; rows are pulled
  in ``forward`` and the gradients of the rows pushed in ``backward`` (or at ``step()``),
  where the table's update rule applies them.
- ``DenseSync``: keeps a model's parameters in Shoal dense tables under any
  consistency model: after the local optimiser's step, the change is pushed and
  the current values pulled back.
- ``to_torch`` / ``to_numpy``: zero-copy views between tensors and arrays.
"""

from shoal.integrations.torch.dense import DenseSync
from shoal.integrations.torch.embedding import Embedding, to_numpy, to_torch

__all__ = ["DenseSync", "Embedding", "to_numpy", "to_torch"]
