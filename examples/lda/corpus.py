"""The Lee corpus (300 news articles, shipped inside the ``gensim`` package) as documents of word ids.

    pip install --no-deps gensim==4.4.0

Words are lower-cased letter runs; the most frequent ones (function words, which every topic would
share) and those seen fewer than ``min_count`` times are dropped.
"""

from __future__ import annotations

import importlib.util
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np


@dataclass(frozen=True)
class Documents:
    tokens: np.ndarray  # int64 word ids, documents one after another
    starts: np.ndarray  # int64, document d is tokens[starts[d]:starts[d + 1]]
    words: list[str]

    @property
    def num_docs(self) -> int:
        return int(self.starts.shape[0] - 1)

    @property
    def vocab(self) -> int:
        return len(self.words)

    def take(self, docs: np.ndarray) -> Documents:
        """Documents ``docs`` only, in that order (the same word ids)."""
        parts = [self.tokens[self.starts[d] : self.starts[d + 1]] for d in docs]
        lengths = np.array([p.shape[0] for p in parts], dtype=np.int64)
        starts = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        tokens = np.concatenate(parts) if parts else np.zeros(0, np.int64)
        return Documents(tokens.astype(np.int64), starts, self.words)


def load_lee(min_count: int = 3, drop_most_frequent: int = 100) -> Documents:
    spec = importlib.util.find_spec("gensim")
    if spec is None or spec.origin is None:
        raise SystemExit("the corpus comes from the gensim package: pip install --no-deps gensim==4.4.0")
    lines = (Path(spec.origin).parent / "test" / "test_data" / "lee_background.cor").read_text().lower().splitlines()
    docs = [re.findall(r"[a-z]+", line) for line in lines if line.strip()]
    words, counts = np.unique([w for d in docs for w in d], return_counts=True)
    order = np.argsort(-counts, kind="stable")
    keep = order[drop_most_frequent:]
    keep = keep[counts[keep] >= min_count]
    vocab = [str(w) for w in words[keep]]
    ids = {w: i for i, w in enumerate(vocab)}
    per_doc = [np.array([ids[w] for w in d if w in ids], dtype=np.int64) for d in docs]
    starts = np.concatenate([[0], np.cumsum([p.shape[0] for p in per_doc])]).astype(np.int64)
    return Documents(np.concatenate(per_doc), starts, vocab)
