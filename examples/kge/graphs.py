"""Knowledge graphs: Kinships and UMLS from the files the ``pykeen`` package ships, and a synthetic Zipf graph.

    pip install --no-deps pykeen==1.11.1
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

import numpy as np


@dataclass(frozen=True)
class Graph:
    train: np.ndarray  # (n, 3) int64: head, relation, tail
    valid: np.ndarray
    test: np.ndarray
    num_entities: int
    num_relations: int


def _pykeen_dir(name: str) -> Path:
    spec = importlib.util.find_spec("pykeen")
    if spec is None or spec.origin is None:
        raise SystemExit(f"{name} comes from the pykeen package: pip install --no-deps pykeen==1.11.1")
    return Path(spec.origin).parent / "datasets" / name


def load_pykeen(name: str) -> Graph:
    """``kinships``, ``umls`` or ``nations``: tab-separated head, relation, tail per line."""
    folder = _pykeen_dir(name)
    parts = {split: [line.rstrip("\n").split("\t") for line in (folder / f"{split}.txt").read_text().splitlines()
                     if line.strip()] for split in ("train", "valid", "test")}
    entities = sorted({x for rows in parts.values() for h, _, t in rows for x in (h, t)})
    relations = sorted({r for rows in parts.values() for _, r, _ in rows})
    e_id = {e: i for i, e in enumerate(entities)}
    r_id = {r: i for i, r in enumerate(relations)}

    def encode(rows: list[list[str]]) -> np.ndarray:
        return np.array([[e_id[h], r_id[r], e_id[t]] for h, r, t in rows], dtype=np.int64)

    return Graph(encode(parts["train"]), encode(parts["valid"]), encode(parts["test"]), len(entities), len(relations))


def synthetic_zipf(num_entities: int = 200_000, num_relations: int = 200, num_triples: int = 1_000_000,
                   exponent: float = 1.1, seed: int = 0) -> Graph:
    """Heads and tails drawn with Zipf(``exponent``) popularity, relations with a milder skew."""
    rng = np.random.default_rng(seed)
    ent = np.arange(1, num_entities + 1, dtype=np.float64) ** -exponent
    ent /= ent.sum()
    rel = np.arange(1, num_relations + 1, dtype=np.float64) ** -0.5
    rel /= rel.sum()
    heads = rng.choice(num_entities, num_triples, p=ent)
    tails = rng.choice(num_entities, num_triples, p=ent)
    rels = rng.choice(num_relations, num_triples, p=rel)
    triples = np.stack([heads, rels, tails], axis=1).astype(np.int64)
    cut = num_triples - 1000
    return Graph(triples[:cut], triples[cut:], triples[cut:], num_entities, num_relations)


def load(name: str) -> Graph:
    if name == "zipf":
        return synthetic_zipf()
    return load_pykeen(name)
