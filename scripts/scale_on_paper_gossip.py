"""scripts/scale_on_paper.py's gossip designs (CHOCO-SGD with a codec as Q, D-PSGD dense):
one message per rank per neighbour per round on the real graph, and the graph's spectral gap.
Imported by scale_on_paper.py (which puts the repository on sys.path first)."""
import numpy as np

from bps_gc.algorithms.gossip import pack
from bps_gc.algorithms.topology import Topology, ring_edges, torus_edges

from scale_on_paper_sizes import GRADIENT_STD, REPLY_HEADER, variable


def edges_of(design, n):
    """The graph of ``design`` (gossip-ring or gossip-torus) on ``n`` ranks."""
    return ring_edges(n) if design == "gossip-ring" else torus_edges(n)


def gossip_counts(design, hosts, local, shapes, params, sizes):
    """One gossip round: every rank sends its packed message (algorithms/gossip.pack of each
    tensor's Q payload) to each neighbour of the real graph; counted where the edge crosses
    hosts (ranks host-major: rank r on host r // L)."""
    n = hosts * local
    message = REPLY_HEADER + len(pack([sizes.gossip(params, int(np.prod(s)), s, GRADIENT_STD, key)
                                       for key, s in enumerate(shapes)]))
    pairs = {(min(i, j), max(i, j)) for i, j in edges_of(design, n) if i != j}  # as Topology dedups them
    out = np.zeros(hosts, np.int64)
    for i, j in pairs:
        if i // local != j // local:
            out[i // local] += 1
            out[j // local] += 1
    busiest = int(out.max())
    return {"out": float(busiest * message), "in": float(busiest * message), "msgs": 2 * busiest,
            "message": message, "reply": ["held" if variable(params) else "exact"],
            "spectral_gap": spectral_gap(design, n)}


_gaps = {}


def spectral_gap(design, n, largest=1024):
    """The graph's consensus rate (Topology.spectral_gap; its n x n eigenproblem: n <= largest)."""
    if n > largest:
        return None
    if (design, n) not in _gaps:
        _gaps[design, n] = Topology(n, edges_of(design, n)).spectral_gap()
    return _gaps[design, n]

