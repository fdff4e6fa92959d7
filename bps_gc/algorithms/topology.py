"""Gossip graphs for decentralized training (CHOCO-SGD, D-PSGD), in numpy.

A topology is an undirected connected graph over the K workers and its mixing matrix ``W``:
symmetric and doubly stochastic, with Metropolis weights ``w_ij = 1/(1 + max(deg i, deg j))``
on edges and ``w_ii = 1 - sum_j w_ij``. On the regular graphs this gives the usual weights: ring
1/3 (self included), 2-D torus 1/5, complete 1/K. Degenerate small cases (a ring of 2, a torus
with a side of 2, where "both" neighbours are one node) count each edge once.
"""
import math

import numpy as np


class Topology:
    """``edges``: pairs (i, j) of workers in [0, size); self loops and duplicates are dropped."""

    def __init__(self, size, edges, name="graph"):
        size = int(size)
        if size < 1:
            raise ValueError(f"{name}: a graph needs at least one worker, got {size}")
        self.size, self.name = size, name
        adjacency = [set() for _ in range(size)]
        for edge in edges:
            if len(edge) != 2:
                raise ValueError(f"{name}: an edge is a pair of ranks, got {edge!r}")
            i, j = (int(v) for v in edge)
            if not (0 <= i < size and 0 <= j < size):
                raise ValueError(f"{name}: edge ({i}, {j}) names a rank outside [0, {size})")
            if i != j:
                adjacency[i].add(j)
                adjacency[j].add(i)
        self._neighbours = [tuple(sorted(a)) for a in adjacency]
        self._check_connected()
        degree = [len(a) for a in self._neighbours]
        w = np.zeros((size, size))
        for i in range(size):
            for j in self._neighbours[i]:
                w[i, j] = 1.0 / (1 + max(degree[i], degree[j]))
            w[i, i] = 1.0 - w[i].sum()
        self.weights = w

    def _check_connected(self):
        seen, frontier = {0}, [0]
        while frontier:
            for j in self._neighbours[frontier.pop()]:
                if j not in seen:
                    seen.add(j)
                    frontier.append(j)
        if len(seen) != self.size:
            lonely = sorted(set(range(self.size)) - seen)
            raise ValueError(f"{self.name}: the graph is not connected (ranks {lonely} cannot be "
                             "reached from rank 0), so the workers would never agree")

    def neighbours(self, rank):
        """The ranks ``rank`` exchanges with (itself excluded), ascending."""
        return self._neighbours[rank]

    def weight(self, i, j):
        return float(self.weights[i, j])

    def spectral_gap(self):
        """1 - |second largest eigenvalue| of W: the consensus rate (larger is faster)."""
        eig = np.sort(np.abs(np.linalg.eigvalsh(self.weights)))[::-1]
        return 1.0 - (eig[1] if self.size > 1 else 0.0)

    def __repr__(self):
        return f"Topology({self.name}, {self.size} workers, degrees {[len(n) for n in self._neighbours]})"


def ring_edges(size):
    return [(i, (i + 1) % size) for i in range(size)]


def ring(size):
    return Topology(size, ring_edges(size), f"ring of {size}")


def torus_shape(size):
    """rows x cols with rows <= cols, as square as the factors of ``size`` allow."""
    rows = max(r for r in range(1, math.isqrt(size) + 1) if size % r == 0)
    return rows, size // rows


def torus(size, shape=None):
    """A 2-D torus: rank r sits at (r // cols, r % cols) and links to its 4 wrap-around
    neighbours. ``shape`` defaults to the squarest factorization (a prime size is a ring)."""
    rows, cols = shape or torus_shape(size)
    return Topology(size, torus_edges(size, (rows, cols)), f"{rows}x{cols} torus")


def torus_edges(size, shape=None):
    """The torus's edges (without building its size x size mixing matrix)."""
    rows, cols = shape or torus_shape(size)
    if rows * cols != size:
        raise ValueError(f"torus: shape {rows}x{cols} does not hold {size} workers")
    edges = []
    for r in range(size):
        y, x = divmod(r, cols)
        edges.append((r, y * cols + (x + 1) % cols))
        edges.append((r, ((y + 1) % rows) * cols + x))
    return edges


def complete(size):
    return Topology(size, [(i, j) for i in range(size) for j in range(i + 1, size)], f"complete graph of {size}")


def parse_edges(text):
    """'0-1,1-2,2-0' -> [(0, 1), (1, 2), (2, 0)]."""
    edges = []
    for item in text.replace(" ", "").split(","):
        if not item:
            continue
        parts = item.split("-")
        if len(parts) != 2 or not all(p.isdigit() for p in parts):
            raise ValueError(f"graph edge {item!r} is not 'i-j' with two ranks (e.g. '0-1,1-2')")
        edges.append((int(parts[0]), int(parts[1])))
    return edges


BUILDERS = {"ring": ring, "torus": torus, "complete": complete}


def check_spec(spec):
    """The ValueError topology() raises for a string ``spec`` at any size (an unknown name, a
    bad edge list): a script checks its flag with it before the job starts."""
    if isinstance(spec, str) and spec not in BUILDERS:
        if "-" not in spec:
            raise ValueError(f"unknown graph topology {spec!r}: use one of {sorted(BUILDERS)} or an "
                             "edge list such as '0-1,1-2,2-3'")
        parse_edges(spec)


def topology(spec, size):
    """A Topology from a name ('ring', 'torus', 'complete'), an edge list string ('0-1,1-2'),
    a list of edges, or a Topology (checked against ``size``)."""
    if isinstance(spec, Topology):
        topo = spec
    elif isinstance(spec, str) and spec in BUILDERS:
        topo = BUILDERS[spec](size)
    elif isinstance(spec, str):
        check_spec(spec)
        topo = Topology(size, parse_edges(spec), "user graph")
    else:
        topo = Topology(size, spec, "user graph")
    if topo.size != size:
        raise ValueError(f"the {topo.name} has {topo.size} workers but the job has {size}")
    return topo
