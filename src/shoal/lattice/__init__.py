"""Pure merge types. No I/O.

- ``sum_lattice``: ``SumLattice``, a G-counter of vectors, and its ``Delta``s
"""
