"""Skip-gram with negative sampling: batches of (centre, context) pairs and a compiled gradient step."""

from __future__ import annotations

from dataclasses import dataclass

import numba
import numpy as np
from corpus import Corpus, analogies, wordsim_pairs


@dataclass(frozen=True)
class Hyper:
    dim: int = 100
    window: int = 5
    negatives: int = 5
    batch: int = 2048  # (centre, context) pairs
    lr: float = 0.025
    subsample: float = 1e-3


def noise_weights(counts: np.ndarray) -> np.ndarray:
    """The word2vec noise distribution: unigram counts to the power 3/4."""
    w = counts.astype(np.float64) ** 0.75
    return w / w.sum()


def keep_probability(corpus: Corpus, h: Hyper) -> np.ndarray:
    """Per word, the chance that one of its tokens is kept in a pass (frequent words are subsampled)."""
    freq = corpus.counts / corpus.counts.sum()
    return np.minimum(1.0, np.sqrt(h.subsample / freq) + h.subsample / freq)  # type: ignore[no-any-return]


def pairs(corpus: Corpus, h: Hyper, rng: np.random.Generator) -> np.ndarray:
    """All (centre, context) pairs of one pass, with frequent words subsampled and random window sizes."""
    keep_p = keep_probability(corpus, h)
    tokens = corpus.tokens[rng.random(corpus.tokens.shape[0]) < keep_p[corpus.tokens]]
    out = []
    for offset in range(1, h.window + 1):
        reach = rng.integers(1, h.window + 1, tokens.shape[0] - offset) >= offset
        left, right = tokens[:-offset][reach], tokens[offset:][reach]
        out.append(np.stack([left, right], axis=1))
        out.append(np.stack([right, left], axis=1))
    all_pairs = np.concatenate(out)
    return all_pairs[rng.permutation(all_pairs.shape[0])]


def centres_by_worker(corpus: Corpus, h: Hyper, workers: int) -> np.ndarray:
    """Per word, the worker that trains the pairs it is the centre of: the words' expected pairs
    balanced over the workers (each word in turn, most frequent first, to the least loaded)."""
    expected = corpus.counts * keep_probability(corpus, h)
    worker_of = np.empty(corpus.vocab, np.int64)
    load = np.zeros(workers)
    for word in np.argsort(-expected, kind="stable"):
        worker_of[word] = int(np.argmin(load))
        load[worker_of[word]] += expected[word]
    return worker_of


def phases(all_pairs: np.ndarray, group_of: np.ndarray, rank: int, workers: int, phase: int, batch: int
           ) -> list[tuple[int, list[np.ndarray]]]:
    """One pass of ``rank``'s pairs in blocks, as PyTorch-BigGraph partitions an embedding's training.

    The words are in groups, a multiple ``per`` of the workers (``group_of``: each word's); a worker
    trains the pairs whose centre word is in one of its groups (``group % workers == rank``), in
    phases of ``phase`` batches, each phase's pairs those whose context word is in one group: worker
    ``w``'s ``(w * per + d) % groups`` in turn ``d``, the turns in order. So no two workers use one
    output row in the same phase, and with ``per >= 2`` the group a worker uses next is one nobody
    uses now: it can move to its next user a phase ahead, and no row is wanted in two places at once.
    Every turn has as many phases and every phase as many batches on every worker (up to ``batch``
    pairs each; shares differ a little), so phases change at the same clocks everywhere.
    Returns ``[(the phase's context group, its batches)]`` in order."""
    groups = int(group_of.max()) + 1
    per = groups // workers
    assert per * workers == groups, "as many groups for each worker"
    centre_w, context_g = group_of[all_pairs[:, 0]] % workers, group_of[all_pairs[:, 1]]
    turn = (context_g - centre_w * per) % groups
    sizes = np.bincount(centre_w * groups + turn, minlength=workers * groups)
    largest = int(sizes.max())
    count = max(1, round(largest / (phase * batch)))  # phases of each turn, of about ``phase`` full batches
    per_phase = max(1, -(-largest // (count * batch)))  # batches, so that none holds more than ``batch`` pairs
    mine = centre_w == rank
    split = [np.array_split(all_pairs[mine & (turn == d)], count * per_phase) for d in range(groups)]
    return [((rank * per + d) % groups, split[d][i * per_phase:(i + 1) * per_phase])
            for i in range(count) for d in range(groups)]


@numba.njit(nogil=True, cache=True)
def distinct(words: np.ndarray, scratch: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The distinct ``words`` in order of first appearance, and each word's slot among them (what
    ``np.unique(..., return_inverse=True)`` gives, in one pass instead of a sort). ``scratch`` is an
    int64 array of -1s, one per word of the vocabulary, and is left as it was found."""
    uniq = np.empty(words.shape[0], dtype=np.int64)
    slots = np.empty(words.shape[0], dtype=np.int64)
    m = 0
    for i in range(words.shape[0]):
        w = words[i]
        s = scratch[w]
        if s < 0:
            s = m
            scratch[w] = m
            uniq[m] = w
            m += 1
        slots[i] = s
    for j in range(m):
        scratch[uniq[j]] = -1
    return uniq[:m], slots


@numba.njit(nogil=True, fastmath=True, cache=True, inline="always")
def _changes(vin: np.ndarray, c: int, vout: np.ndarray, o: int, positive: bool, lr: float, d_in: np.ndarray,
             at_in: int, d_out: np.ndarray, at_out: int) -> None:
    """One score (centre row ``c`` of ``vin``, output row ``o`` of ``vout``; a context if ``positive``, else
    a negative): its SGD changes to both rows added to ``d_in[at_in]`` and ``d_out[at_out]``."""
    dim = vin.shape[1]
    s = np.float32(0.0)
    for k in range(dim):
        s += vin[c, k] * vout[o, k]
    label = 1.0 if positive else 0.0
    g = np.float32(lr * (label - 1.0 / (1.0 + np.exp(-s))))
    for k in range(dim):
        d_in[at_in, k] += g * vout[o, k]
        d_out[at_out, k] += g * vin[c, k]


@numba.njit(nogil=True, fastmath=True, cache=True)
def sgns_step(in_rows: np.ndarray, out_rows: np.ndarray, centres: np.ndarray, contexts: np.ndarray,
              negs: np.ndarray, lr: float, d_in: np.ndarray, d_out: np.ndarray) -> None:
    """SGD changes for a batch of pairs, from the rows as they were before it: ``centres``,
    ``contexts`` and ``negs`` are slots of ``in_rows``/``out_rows``, and each row's changes are
    summed into the same slot of ``d_in``/``d_out``. (The loss is not computed: a logarithm per
    score, no use in training.)"""
    for b in range(centres.shape[0]):
        c = centres[b]
        for j in range(negs.shape[1] + 1):
            o = contexts[b] if j == 0 else negs[b, j - 1]
            _changes(in_rows, c, out_rows, o, j == 0, lr, d_in, c, d_out, o)


@numba.njit(nogil=True, fastmath=True, cache=True)
def sgns_steps_in_place(vin: np.ndarray, vout: np.ndarray, centres: np.ndarray, contexts: np.ndarray,
                        negs: np.ndarray, which: np.ndarray, step: int, lr: float) -> None:
    """SGD steps of ``step`` pairs each on the rows where they lie: the pairs ``which`` in turn, each
    step's changes computed from the rows as they were before it (as ``sgns_step`` computes a batch's)
    and added to them after it. ``step=1`` is word2vec's own update, pair by pair. ``centres``,
    ``contexts`` and ``negs`` are rows of ``vin`` and ``vout``."""
    dim = vin.shape[1]
    size = min(step, which.shape[0])
    d_in = np.zeros((size, dim), np.float32)
    d_out = np.zeros((size * (negs.shape[1] + 1), dim), np.float32)
    for first in range(0, which.shape[0], step):
        chunk = which[first:first + step]
        n_out = 0
        for i in range(chunk.shape[0]):
            b = chunk[i]
            c = centres[b]
            for j in range(negs.shape[1] + 1):
                o = contexts[b] if j == 0 else negs[b, j - 1]
                _changes(vin, c, vout, o, j == 0, lr, d_in, i, d_out, n_out)
                n_out += 1
        n_out = 0
        for i in range(chunk.shape[0]):
            b = chunk[i]
            c = centres[b]
            for k in range(dim):
                vin[c, k] += d_in[i, k]
                d_in[i, k] = 0.0
            for j in range(negs.shape[1] + 1):
                o = contexts[b] if j == 0 else negs[b, j - 1]
                for k in range(dim):
                    vout[o, k] += d_out[n_out, k]
                    d_out[n_out, k] = 0.0
                n_out += 1


def evaluate(vin: np.ndarray, corpus: Corpus) -> dict[str, float]:
    """Spearman correlation on WordSim-353 and accuracy on the analogies (3CosAdd, among the vocabulary);
    on a planted corpus, how many of each word's 10 nearest vectors are of its cluster."""
    norm = vin / np.maximum(np.linalg.norm(vin, axis=1, keepdims=True), 1e-9)
    if corpus.clusters is not None:
        return {"cluster_purity": cluster_purity(norm, corpus.clusters)}
    pairs_, human = wordsim_pairs(corpus)
    cos = np.sum(norm[pairs_[:, 0]] * norm[pairs_[:, 1]], axis=1)
    rho = float(np.corrcoef(np.argsort(np.argsort(cos)), np.argsort(np.argsort(human)))[0, 1])
    quads = analogies(corpus)
    correct = 0
    for a, b, c, d in quads:
        target = norm[b] - norm[a] + norm[c]
        sims = norm @ target
        sims[[a, b, c]] = -np.inf
        correct += int(np.argmax(sims) == d)
    return {"wordsim_spearman": rho, "wordsim_pairs": int(pairs_.shape[0]),
            "analogy_accuracy": correct / max(len(quads), 1), "analogies": int(len(quads))}


def cluster_purity(norm: np.ndarray, clusters: np.ndarray, k: int = 10) -> float:
    """Mean over words of the share of its ``k`` nearest (cosine) other words in its own cluster; by
    chance about the cluster's share of the vocabulary."""
    sims = norm @ norm.T
    np.fill_diagonal(sims, -np.inf)
    nearest = np.argpartition(-sims, k, axis=1)[:, :k]
    return float(np.mean(clusters[nearest] == clusters[:, None]))
