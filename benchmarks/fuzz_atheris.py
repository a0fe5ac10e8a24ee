"""Coverage-guided fuzzing of the wire decoder and the server with atheris (libFuzzer).

    python benchmarks/fuzz_atheris.py --runs 50000 --seconds 600 --work DIR

Started by ``benchmarks/fuzz.py``, which reads the counts libFuzzer prints (it
ends this process itself, so nothing here runs after the last input). Each input
is split into frames (a count byte, then a 4-byte length before each frame) and
goes through the same checks as the Hypothesis targets: the decoder (plain and
with a secret) must return a message that fits its schema or raise a
``ShoalError``, and a ``FuzzServer`` must answer it without a handler failing;
every 1,000 inputs its timers run and its protected table must be unchanged
(the other tables are not checked for NaN/Inf here: pushes of huge finite values
overflow, which the NaN/Inf policy does not cover).
The corpus starts from a valid message of every op; crashing inputs land in
``--work``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import atheris
import numpy as np

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent)]

# Shoal's Python code is instrumented for coverage as it is imported here; the numba
# kernels must stay as they are (numba cannot compile the instrumented bytecode).
with atheris.instrument_imports(include=["shoal"], exclude=["shoal.storage.kernels", "shoal.placement.kernels"]):
    from tests.support.fuzz_frames import check_decode
    from tests.support.fuzz_server import FuzzServer
    from tests.support.fuzzing import FUZZ_TABLES, LIMITS, SECRET, encoded

    from shoal.api.ids import SERVERS
    from shoal.cluster.replay import new_incarnation
    from shoal.wire import Codec, Message
    from shoal.wire.schema import SCHEMAS

CHECK_EVERY = 1000


def split_frames(data: bytes) -> list[bytes]:
    """A count byte, then each frame as a 4-byte little-endian length and its bytes (the last takes the rest)."""
    if not data:
        return []
    frames, at = [], 1
    for _ in range(data[0] % 6):
        size = int.from_bytes(data[at:at + 4], "little")
        at += 4
        frames.append(data[at:at + size])
        at += size
    return frames


def joined(frames: list[bytes]) -> bytes:
    return bytes([len(frames)]) + b"".join(len(f).to_bytes(4, "little") + f for f in frames)


def seeds() -> list[bytes]:
    """A plausible message of every op for every fuzz table, as a first corpus (each its own stream of
    requests, so that the replay window lets it through)."""
    fields = {int: 0, str: "x", list: [], dict: FUZZ_TABLES[0].to_dict(), bool: False}
    keys, rows = np.arange(3, dtype=np.int64), np.ones((3, 4), dtype=np.float32)
    out = []
    for op, schema in SCHEMAS.items():
        body = {name: fields[kind] for name, kind in schema.body.items()}
        arrays = [keys if rule.kind == "i" else rows for rule in schema.arrays] if not schema.variadic else [
            keys, rows]
        for spec in FUZZ_TABLES:
            for sender in (0, SERVERS + 1):
                out.append(joined(encoded(Message(op, req=1, table=spec.name, sender=sender, body=body,
                                                  incarnation=new_incarnation(), arrays=arrays))))
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, required=True)
    parser.add_argument("--seconds", type=int, required=True)
    parser.add_argument("--work", type=Path, required=True)
    args = parser.parse_args()
    corpus = args.work / "corpus"
    corpus.mkdir(parents=True, exist_ok=True)
    for i, seed in enumerate(seeds()):
        (corpus / f"seed-{i:04d}").write_bytes(seed)

    plain, signed = Codec(LIMITS), Codec(LIMITS, SECRET)
    fuzz = FuzzServer()
    runs = 0

    def one_input(data: bytes) -> None:
        nonlocal runs
        frames = split_frames(data)
        check_decode(plain, frames)
        check_decode(signed, frames)
        fuzz.feed(frames)
        runs += 1
        if runs % CHECK_EVERY == 0:
            fuzz.tick()
            fuzz.check_intact(finite=False)  # raw bytes make finite values huge enough to overflow when summed

    atheris.Setup([sys.argv[0], f"-runs={args.runs}", f"-max_total_time={args.seconds}", "-max_len=4096",
                   "-timeout=10", "-rss_limit_mb=4096", f"-artifact_prefix={args.work}/", str(corpus)], one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
