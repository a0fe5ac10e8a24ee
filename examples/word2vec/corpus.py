"""Corpora: the Lee corpus and the similarity and analogy files that the ``gensim`` package ships,
and a synthetic corpus of planted word clusters, on which quality can be measured.

    pip install --no-deps gensim==4.4.0
"""

from __future__ import annotations

import importlib.util
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np


def _test_data() -> Path:
    spec = importlib.util.find_spec("gensim")
    if spec is None or spec.origin is None:
        raise SystemExit("the corpus comes from the gensim package: pip install --no-deps gensim==4.4.0")
    return Path(spec.origin).parent / "test" / "test_data"


@dataclass(frozen=True)
class Corpus:
    tokens: np.ndarray  # word ids, the corpus in order (frequent words subsampled at training time)
    words: list[str]
    counts: np.ndarray
    clusters: np.ndarray | None = None  # planted corpora: each word's cluster

    @property
    def vocab(self) -> int:
        return len(self.words)

    def index(self) -> dict[str, int]:
        return {w: i for i, w in enumerate(self.words)}


def load_lee(min_count: int = 2) -> Corpus:
    text = (_test_data() / "lee_background.cor").read_text().lower()
    raw = re.findall(r"[a-z]+", text)
    words, counts = np.unique(raw, return_counts=True)
    keep = counts >= min_count
    order = np.argsort(-counts[keep], kind="stable")
    words, counts = words[keep][order], counts[keep][order]
    ids = {w: i for i, w in enumerate(words)}
    tokens = np.array([ids[w] for w in raw if w in ids], dtype=np.int64)
    return Corpus(tokens, [str(w) for w in words], counts.astype(np.int64))


def load(name: str) -> Corpus:
    return load_lee() if name == "lee" else planted()


def planted(num_clusters: int = 40, words_per_cluster: int = 50, sentences: int = 3_000, length: int = 20,
            noise: float = 0.6, seed: int = 0) -> Corpus:
    """Sentences each about one cluster of words (Zipf-like frequencies within it), with ``noise`` of
    their words drawn from anywhere: a word's true neighbours are its cluster, so how many of its
    nearest vectors share it measures what training learnt (the Lee corpus is too small for
    WordSim-353 to). 60,000 tokens like the Lee corpus; the noise keeps 10 passes of the
    single-process baseline near 0.6 of the way, where a worse model shows."""
    rng = np.random.default_rng(seed)
    weights = 1.0 / np.arange(1, words_per_cluster + 1) ** 0.8
    topics = rng.integers(0, num_clusters, sentences)
    tokens = topics[:, None] * words_per_cluster + rng.choice(words_per_cluster, (sentences, length),
                                                                p=weights / weights.sum())
    stray = rng.random(tokens.shape) < noise
    tokens[stray] = rng.integers(0, num_clusters * words_per_cluster, int(stray.sum()))
    tokens = tokens.reshape(-1).astype(np.int64)
    vocab = num_clusters * words_per_cluster
    return Corpus(tokens, [f"c{w // words_per_cluster}w{w % words_per_cluster}" for w in range(vocab)],
                  np.bincount(tokens, minlength=vocab).astype(np.int64),
                  np.arange(vocab) // words_per_cluster)


def wordsim_pairs(corpus: Corpus) -> tuple[np.ndarray, np.ndarray]:
    """Word-id pairs of WordSim-353 found in the vocabulary, and their human scores."""
    index = corpus.index()
    pairs, scores = [], []
    for line in (_test_data() / "wordsim353.tsv").read_text().splitlines():
        if line.startswith("#"):
            continue
        a, b, s = line.lower().split("\t")
        if a in index and b in index:
            pairs.append((index[a], index[b]))
            scores.append(float(s))
    return np.array(pairs, dtype=np.int64), np.array(scores)


def analogies(corpus: Corpus) -> np.ndarray:
    """(a, b, c, d) id quadruples of the analogy file found in the vocabulary: a is to b as c is to d."""
    index = corpus.index()
    quads = []
    for line in (_test_data() / "questions-words.txt").read_text().lower().splitlines():
        if line.startswith(":"):
            continue
        parts = line.split()
        if len(parts) == 4 and all(p in index for p in parts):
            quads.append([index[p] for p in parts])
    return np.array(quads, dtype=np.int64).reshape(-1, 4)
