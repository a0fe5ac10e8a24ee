"""Biased MF on MovieLens 100k with a PyTorch model whose embeddings live in Shoal.

    shoal run --nodes 2 -- python examples/mf/train_torch.py

The model is ordinary PyTorch: two ``shoal.integrations.torch.Embedding`` layers
(user rows ``[p_u, b_u]`` and item rows ``[q_i, b_i]``) and a squared-error loss.
``backward()`` sends the rows' gradients to the servers, whose SGD rule applies
them; there is no torch optimiser.
"""

from __future__ import annotations

import argparse
import json

import numpy as np
import torch
from data import load_movielens
from model import Hyper

import shoal
from shoal.integrations.torch import Embedding


class BiasedMF(torch.nn.Module):
    def __init__(self, users: Embedding, items: Embedding, mu: float) -> None:
        super().__init__()
        self.users, self.items, self.mu = users, items, mu

    def forward(self, u: torch.Tensor, i: torch.Tensor) -> torch.Tensor:
        pu, qi = self.users(u), self.items(i)
        k = pu.shape[1] - 1
        return self.mu + (pu[:, :k] * qi[:, :k]).sum(1) + pu[:, k] + qi[:, k]


def main() -> None:
    h = Hyper()
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=h.epochs)
    p.add_argument("--out")
    args = p.parse_args()
    torch.set_num_threads(1)
    ps = shoal.init()
    data = load_movielens()
    opts = dict(init=shoal.Normal(std=h.init_std), optimizer=shoal.optim.SGD(lr=h.lr))
    users = Embedding(ps.table("torch.users", data.num_users, h.rank + 1, **opts))
    items = Embedding(ps.table("torch.items", data.num_items, h.rank + 1, **opts))
    mu = float(data.train.values.mean())
    model = BiasedMF(users, items, mu)
    mine = data.train.take(np.arange(ps.rank, len(data.train), ps.num_workers))
    history = []
    for epoch in range(args.epochs):
        order = np.random.default_rng(1000 + epoch).permutation(len(mine))
        for s in range(0, len(mine), h.batch):
            idx = order[s : s + h.batch]
            u = torch.from_numpy(mine.users[idx])
            i = torch.from_numpy(mine.items[idx])
            r = torch.from_numpy(mine.values[idx])
            pred = model(u, i)
            # The gradient of 0.5 * error^2 + 0.5 * reg * |rows|^2, per rating, as the numpy model uses.
            pu, qi = users(u), items(i)
            loss = 0.5 * ((r - pred) ** 2).sum() + 0.5 * h.reg * ((pu**2).sum() + (qi**2).sum())
            loss.backward()
            users.step()
            items.step()
            ps.advance_clock()
        ps.barrier()
        if ps.rank == 0:
            with torch.no_grad():
                pred = model(torch.from_numpy(data.test.users), torch.from_numpy(data.test.items)).clamp(1, 5)
                history.append(float(torch.sqrt(((pred - torch.from_numpy(data.test.values)) ** 2).mean())))
            print(f"epoch {epoch + 1:2d}  test RMSE {history[-1]:.4f}", flush=True)
        ps.barrier()
    if ps.rank == 0 and args.out:
        with open(args.out, "w") as fh:
            json.dump({"rmse": history}, fh)
    ps.shutdown()


if __name__ == "__main__":
    main()
