"""An MLP on scikit-learn's digits, with its parameters kept in Shoal under SSP.

    shoal run --nodes 2 -- python examples/digits/train.py --staleness 1

Each worker trains the same PyTorch model on its half of the training set with
its own optimiser; ``DenseSync`` pushes each step's change to the servers and
pulls the current parameters, at most ``staleness`` clocks behind the slowest
worker. Rank 0 reports test accuracy.
"""

from __future__ import annotations

import argparse
import json

import numpy as np
import torch
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

import shoal
from shoal.integrations.torch import DenseSync


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--staleness", type=int, default=1)
    p.add_argument("--out")
    args = p.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    x, y = load_digits(return_X_y=True)
    x_train, x_test, y_train, y_test = train_test_split(x / 16.0, y, test_size=0.25, random_state=0, stratify=y)
    ps = shoal.init()
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
    sync = DenseSync(ps, model, prefix="digits", consistency=shoal.SSP(args.staleness))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    xs = torch.tensor(x_train[ps.rank::ps.num_workers], dtype=torch.float32)
    ys = torch.tensor(y_train[ps.rank::ps.num_workers])
    rng = np.random.default_rng(ps.rank)
    for _ in range(args.epochs):
        order = torch.from_numpy(rng.permutation(len(xs)))
        for s in range(0, len(xs), 32):
            idx = order[s : s + 32]
            optimizer.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(xs[idx]), ys[idx])
            loss.backward()
            optimizer.step()
            sync.step()
    ps.barrier()
    sync.step()  # one more clock: under the bound, the read now includes every worker's last change
    with torch.no_grad():
        accuracy = float((model(torch.tensor(x_test, dtype=torch.float32)).argmax(1) == torch.tensor(y_test))
                         .float().mean())
    if ps.rank == 0:
        print(f"test accuracy {accuracy:.4f}")
        if args.out:
            with open(args.out, "w") as fh:
                json.dump({"accuracy": accuracy}, fh)
    ps.barrier()
    ps.shutdown()


if __name__ == "__main__":
    main()
