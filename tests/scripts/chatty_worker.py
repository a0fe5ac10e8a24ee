"""A worker that writes many lines in pieces, as print(..., end="") and unbuffered output do.

    chatty_worker.py LINES

Every line reads ``rank R line I xxx... end``; each is written in three pieces, each its own
write to the pipe (the launcher runs workers unbuffered). Every 50 lines it also draws a progress
bar redrawn with carriage returns.
"""

from __future__ import annotations

import sys
import time

import shoal


def main() -> None:
    ps = shoal.init()
    for i in range(int(sys.argv[1])):
        sys.stdout.write(f"rank {ps.rank} line {i} ")
        sys.stdout.write("x" * (i % 40))
        sys.stdout.write(" end\n")
        if i % 50 == 0:
            for done in range(0, 101, 25):
                sys.stdout.write(f"\rrank {ps.rank} progress {done}%")
                time.sleep(0.001)
            sys.stdout.write("\n")
    ps.shutdown()


if __name__ == "__main__":
    main()
