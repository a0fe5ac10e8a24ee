"""The PyTorch integration: Embedding rows in Shoal, dense models kept in sync, zero-copy views."""

from __future__ import annotations

import json
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the torch extra is not installed: pip install torch==2.13.0")

import shoal  # noqa: E402
from shoal.integrations.torch import DenseSync, Embedding, to_numpy, to_torch  # noqa: E402
from tests.support.cluster import ThreadCluster, fail_first_static_push  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def test_views_share_memory():
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    t = to_torch(a)
    t[0, 0] = 7
    assert a[0, 0] == 7
    back = to_numpy(t)
    assert np.shares_memory(back, a)


@pytest.mark.parametrize("push", ["backward", "step"])
def test_embedding_pulls_rows_and_pushes_their_gradients(push):
    with ThreadCluster(nodes=2) as c:
        table = c.worker(0).table("emb", 10, 3, init=shoal.Constant(1.0), optimizer=shoal.optim.SGD(lr=0.5))
        emb = Embedding(table, push=push)
        keys = torch.tensor([[1, 7], [7, 9]])
        out = emb(keys)
        assert out.shape == (2, 2, 3)
        out.sum().backward()
        emb.step()
        rows = table.pull(np.array([1, 7, 9, 0]))
        np.testing.assert_allclose(rows[:, 0], [0.5, 0.0, 0.5, 1.0])  # key 7 got two gradients of 1


def test_dense_sync_keeps_workers_on_the_same_parameters():
    with ThreadCluster(nodes=2, workers_per_node=1) as c:
        def body(w):
            torch.manual_seed(w.rank)  # different local initialisations: rank 0's win
            model = torch.nn.Linear(4, 2)
            sync = DenseSync(w, model, prefix="lin", consistency=shoal.SSP(1))
            start = [p.detach().clone() for p in model.parameters()]
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(1.0)  # each worker changes every parameter by +1
            sync.step()
            w.barrier()
            # Under SSP(1) a read at clock 1 may miss clock-0 changes; at clock 2 it may not.
            sync.step()
            return start, [p.detach().clone() for p in model.parameters()]

        (s0, e0), (s1, e1) = c.run_workers(body)
        for a, b in zip(s0, s1, strict=True):
            assert torch.equal(a, b)
        for start, end, other in zip(s0, e0, e1, strict=True):
            assert torch.allclose(end, start + 2.0) and torch.equal(end, other)


def run(args: list[str], tmp: Path) -> dict:
    out = tmp / "out.json"
    proc = subprocess.run([sys.executable, "-m", "shoal.launch.cli", "run", "--nodes", "2", "--", sys.executable,
                           *args, "--out", str(out)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text())


def test_mlp_on_digits_through_the_dense_synchroniser_under_ssp(tmp_path):
    pytest.importorskip("sklearn", reason="the digits come from scikit-learn")
    r = run([str(ROOT / "examples" / "digits" / "train.py"), "--staleness", "1", "--epochs", "20"], tmp_path)
    assert r["accuracy"] >= 0.95, r


def test_mf_with_shoal_embeddings_reaches_094(tmp_path):
    r = run([str(ROOT / "examples" / "mf" / "train_torch.py"), "--epochs", "20"], tmp_path)
    assert min(r["rmse"]) <= 0.94, r["rmse"]


class _Scaled(torch.nn.Module):
    """A model with a 0-d parameter next to a Shoal embedding (whose anchor is 0-d too)."""

    def __init__(self, table: shoal.Table) -> None:
        super().__init__()
        self.embedding = Embedding(table)
        self.scale = torch.nn.Parameter(torch.tensor(2.0))
        self.head = torch.nn.Linear(3, 1)

    def forward(self, keys: torch.Tensor) -> torch.Tensor:
        return self.head(self.embedding(keys) * self.scale)


def test_dense_sync_keeps_0d_parameters_and_leaves_an_embeddings_rows_to_its_table():
    with ThreadCluster(nodes=2, workers_per_node=1) as c:
        def body(w):
            torch.manual_seed(w.rank)
            model = _Scaled(w.table("rows", 10, 3, init=shoal.Constant(1.0), optimizer=shoal.optim.SGD(lr=0.1)))
            sync = DenseSync(w, model, prefix="scaled")
            synced = sorted(name for name, _ in sync.params)
            with torch.no_grad():
                model.scale.add_(1.0)  # each worker adds 1 to the scalar
            sync.step()
            w.barrier()
            sync.step()
            model(torch.tensor([1, 2])).sum().backward()
            model.embedding.step()
            return synced, float(model.scale.detach())

        (names, scale0), (_, scale1) = c.run_workers(body)
        assert names == ["head.bias", "head.weight", "scale"]  # not embedding._anchor
        assert scale0 == scale1 == 4.0  # rank 0's 2.0, plus 1 from each worker


def test_an_embedding_refuses_float_keys_as_a_table_does():
    with ThreadCluster(nodes=1) as c:
        table = c.worker(0).table("emb", 10, 3)
        with pytest.raises(shoal.DTypeError, match="must be integers"):
            table.pull(np.array([1.0, 2.0]))
        with pytest.raises(shoal.DTypeError, match="must be integers, got dtype torch.float32"):
            Embedding(table)(torch.tensor([1.0, 2.0]))


def _torch_train(w, root: Path, start: int, stop: int, save_at: int | None):
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2, bias=False)
    sync = DenseSync(w, model, prefix="lin", consistency=shoal.BSP())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    if start:
        assert w.restore(root) == start
    x = torch.arange(6, dtype=torch.float32).reshape(2, 3) / 6
    for step in range(start, stop):
        if step == save_at:
            w.checkpoint(root)
        opt.zero_grad()
        ((model(x) - 1.0) ** 2).sum().backward()
        opt.step()
        sync.step()
    return model.weight.detach().numpy().copy()


def test_a_dense_sync_model_resumed_from_a_checkpoint_trains_from_the_restored_weights(tmp_path: Path) -> None:
    # DenseSync creates its tables, so a restore comes after it (README: "after creating the
    # tables"); but DenseSync pulled the weights into the torch model and its _synced copy before the
    # restore and never again until the next step (integrations/torch/dense.py __init__/_load): the
    # first resumed step computes its gradient at the initial weights and pushes that change on top of
    # the restored ones. The run resumed at step 2 does not end where the run never stopped does.
    pytest.importorskip("torch")
    with ThreadCluster(nodes=1) as cluster:
        uninterrupted = _torch_train(cluster.worker(0), tmp_path, 0, 4, save_at=2)
    with ThreadCluster(nodes=1) as cluster:
        resumed = _torch_train(cluster.worker(0), tmp_path, 2, 4, save_at=None)
    np.testing.assert_array_equal(resumed, uninterrupted)


def test_an_embeddings_failed_push_is_raised_once_not_into_every_later_forward():
    with ThreadCluster(nodes=2) as c:
        w = c.worker(0)
        emb = Embedding(w.table("e", 40, 2))
        fail_first_static_push(c, 1)
        emb(torch.tensor([30])).sum().backward()  # its push (to node 1) fails
        with pytest.raises(shoal.ShoalError, match="injected"):
            emb(torch.tensor([1]))  # the failure surfaces at the next forward: right
        emb(torch.tensor([1]))  # an unrelated later forward must not raise the same error again


def test_dense_sync_keeps_a_float64_models_updates():
    """DenseSync promises that after ``optimizer.step(); sync.step()`` the model holds its own change
    (on one worker: exactly what plain torch computed). Shoal has float64 tables, but DenseSync made
    every table with the default dtype float32, so a float64 model was rounded to float32 at
    construction and at every step; a change below float32's resolution (1e-9 on a weight of 1.0)
    was pushed, rounded away and lost: the weight was 1.0 again."""
    with ThreadCluster(nodes=1) as c:
        w = c.worker(0)
        model = torch.nn.Linear(1, 1, bias=False).double()
        with torch.no_grad():
            model.weight.fill_(1.0)
        sync = DenseSync(w, model, prefix="f64")
        for _ in range(10):
            with torch.no_grad():
                model.weight.add_(1e-9)  # what an optimiser step with a small gradient does
            sync.step()
        # plain torch: 1 + 1e-8; seen: exactly 1.0 (every change rounded away in the float32 table)
        assert abs(model.weight.item() - (1.0 + 1e-8)) < 1e-12, model.weight.item() - 1.0


def test_dense_sync_keeps_a_bfloat16_model_in_float32_tables():
    """DenseSync of a bfloat16 model (a common training dtype) raised torch's bare ``TypeError: Got
    unsupported ScalarType BFloat16`` (numpy has no bfloat16). Narrow floats are kept in float32
    tables now; what a step pushes is the model's own change, not the rounding of loading the
    table's values into bfloat16."""
    with ThreadCluster(nodes=1) as c:
        w = c.worker(0)
        model = torch.nn.Linear(3, 2, bias=False).to(torch.bfloat16)
        with torch.no_grad():
            model.weight.fill_(0.1)
        sync = DenseSync(w, model, prefix="bf16")
        start = model.weight.detach().float().numpy().copy()
        np.testing.assert_array_equal(sync.tables[0].pull(), start)
        for _ in range(3):
            sync.step()  # no change of the model's: the table must not move
        np.testing.assert_array_equal(sync.tables[0].pull(), start)
        with torch.no_grad():
            model.weight.add_(0.5)
        changed = model.weight.detach().float().numpy().copy()
        sync.step()
        np.testing.assert_array_equal(sync.tables[0].pull(), changed)
        assert model.weight.dtype == torch.bfloat16
        np.testing.assert_array_equal(model.weight.detach().float().numpy(), changed)
        with pytest.raises(shoal.DTypeError, match="floating-point"):
            holder = torch.nn.Module()
            holder.w = torch.nn.Parameter(torch.zeros(2, dtype=torch.complex64))
            DenseSync(w, holder, prefix="complex")


def test_a_second_dense_sync_does_not_change_the_model_it_wraps():
    """DenseSync: 'Rank 0's initial values become everyone's'. Its tables were assumed to start at
    zero (rank 0 *added* its values), but ``ps.dense`` hands back the existing table when a table of
    that name and spec exists: a second DenseSync on the same model (a new training phase, a rebuilt
    optimiser) doubled its weights, and two models under the default prefix ``"dense"`` with
    same-shaped parameters silently shared (summed) their parameters. Rank 0 now sets the tables to
    its values, and a prefix another live model holds is refused."""
    with ThreadCluster(nodes=1) as c:
        w = c.worker(0)
        model = torch.nn.Linear(2, 2)
        with torch.no_grad():
            model.weight.fill_(1.0)
            model.bias.fill_(0.5)
        DenseSync(w, model)
        with torch.no_grad():
            model.weight.fill_(2.0)
        DenseSync(w, model)  # again, same model, same (default) prefix: from the model's values now
        assert torch.equal(model.weight, torch.full((2, 2), 2.0)), model.weight  # seen: all 3.0
        other = torch.nn.Linear(2, 2)
        with torch.no_grad():
            other.weight.fill_(3.0)
        with pytest.raises(shoal.ConfigError, match="prefix 'dense'"):
            DenseSync(w, other)  # another model, default prefix: would be mixed with the first one
        DenseSync(w, other, prefix="other")
        assert torch.equal(other.weight, torch.full((2, 2), 3.0)), other.weight
        assert torch.equal(model.weight, torch.full((2, 2), 2.0)), model.weight


def test_an_embedding_used_twice_in_one_batch_takes_one_adagrad_step_like_torch():
    """Embedding: 'Duplicate keys are summed by the table, whose update rule (SGD, Adagrad, Adam)
    runs where the rows live' — one rule step per batch, as torch's sparse nn.Embedding + Adagrad
    takes. With push='backward', a module called twice in one forward (user and item ids from one
    table, a shared vocabulary) gets one autograd backward call per use, and each pushed on its own:
    keys in both uses got two Adagrad steps with partial gradients (0.3293 instead of 0.4 below).
    The module now pushes once, at the end of the backward pass."""
    warnings.filterwarnings("ignore", message="Sparse invariant checks")
    u, i = torch.tensor([0, 1, 2]), torch.tensor([1, 2, 3])
    ref = torch.nn.Embedding(4, 2, sparse=True)
    with torch.no_grad():
        ref.weight.fill_(0.5)
    opt = torch.optim.Adagrad(ref.parameters(), lr=0.1)
    opt.zero_grad()
    (ref(u) * ref(i)).sum().backward()
    opt.step()
    with ThreadCluster(nodes=1) as c:
        table = c.worker(0).table("e", 4, 2, init=shoal.Constant(0.5), optimizer=shoal.optim.Adagrad(lr=0.1))
        emb = Embedding(table, push="backward")
        (emb(u) * emb(i)).sum().backward()
        emb.step()
        np.testing.assert_allclose(table.pull(np.arange(4)), ref.weight.detach().numpy(), atol=1e-6)


def test_zero_grad_discards_an_embeddings_kept_gradients():
    """With push='step' an Embedding keeps its row gradients until ``step()``, as torch keeps
    ``.grad`` until ``optimizer.step()``. torch's ``model.zero_grad()`` (or the optimiser's) discards
    gradients of a batch the loop decided not to apply (a skipped step: NaN loss, AMP overflow, a
    gradient-accumulation restart); the Embedding ignored it (its kept batches were cleared only by
    ``step()``), so the discarded batch was applied at the next step: with plain torch the rows do
    not move, here they did. A batch kept after the ``zero_grad`` is applied."""
    with ThreadCluster(nodes=1) as c:
        table = c.worker(0).table("e", 4, 2, init=shoal.Constant(1.0), optimizer=shoal.optim.SGD(lr=0.5))
        model = torch.nn.Sequential(Embedding(table, push="step"))
        model(torch.tensor([1, 2])).sum().backward()
        model.zero_grad()  # discard this batch
        model[0].step()  # nothing left to apply
        np.testing.assert_array_equal(table.pull(np.arange(4)), np.ones((4, 2), np.float32))
        model(torch.tensor([0])).sum().backward()
        model.zero_grad()
        model(torch.tensor([3])).sum().backward()  # only this batch is applied
        model[0].step()
        np.testing.assert_array_equal(table.pull(np.arange(4)), [[1, 1], [1, 1], [1, 1], [0.5, 0.5]])
