"""Collapsed Gibbs sampling for LDA (Griffiths and Steyvers, 2004), one sweep in compiled code, and the
model's log-likelihood."""

from __future__ import annotations

import math

import numba
import numpy as np


@numba.njit(cache=True)
def sweep(tokens: np.ndarray, starts: np.ndarray, rows: np.ndarray, topics: np.ndarray, doc_topic: np.ndarray,
          word_topic: np.ndarray, totals: np.ndarray, alpha: float, beta: float, vocab: int, seed: int) -> None:
    """Resample the topic of every token of the documents, in place.

    ``rows[i]`` is the row of token ``i``'s word in ``word_topic`` (this worker's copy of the rows it
    uses); ``doc_topic`` counts per document of these, ``totals`` per topic. The copies are changed
    as tokens move, so later tokens see this sweep's moves (the worker's own writes); counts that
    stale reads make negative count as zero.
    """
    np.random.seed(seed)
    k = word_topic.shape[1]
    weights = np.empty(k)
    v_beta = vocab * beta
    for d in range(starts.shape[0] - 1):
        for i in range(starts[d], starts[d + 1]):
            row, old = rows[i], topics[i]
            doc_topic[d, old] -= 1
            word_topic[row, old] -= 1
            totals[old] -= 1
            acc = 0.0
            for t in range(k):
                n_wt = max(word_topic[row, t], 0.0)
                n_t = max(totals[t], 0.0)
                acc += (doc_topic[d, t] + alpha) * (n_wt + beta) / (n_t + v_beta)
                weights[t] = acc
            u = np.random.random() * acc
            new = 0
            while weights[new] < u:
                new += 1
            topics[i] = new
            doc_topic[d, new] += 1
            word_topic[row, new] += 1
            totals[new] += 1


def log_likelihood(word_topic: np.ndarray, beta: float) -> float:
    """log p(words | topics) with the topic-word distributions integrated out (the word part of the
    collapsed joint likelihood, as Petuum's and Bosen's LDA report it)."""
    counts = np.maximum(word_topic.astype(np.float64), 0.0)
    vocab, k = counts.shape
    lgamma = np.vectorize(math.lgamma)
    per_topic = math.lgamma(vocab * beta) - vocab * math.lgamma(beta)
    return float(k * per_topic + lgamma(counts + beta).sum() - lgamma(counts.sum(axis=0) + vocab * beta).sum())
