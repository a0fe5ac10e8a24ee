"""The Lee corpus and the similarity and analogy files that the ``gensim`` package ships.

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
