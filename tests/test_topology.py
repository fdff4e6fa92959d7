"""Gossip graphs: the mixing matrices of spec §5 (ring 1/3, torus 1/5, complete 1/K, Metropolis
for any user graph), symmetric and doubly stochastic; bad graphs fail naming the cause."""
import numpy as np
import pytest

from bps_gc.algorithms.topology import Topology, complete, ring, topology, torus


def check_mixing(topo):
    w = topo.weights
    assert np.allclose(w, w.T) and np.allclose(w.sum(0), 1) and np.allclose(w.sum(1), 1)
    assert (w >= 0).all()
    for i in range(topo.size):
        assert set(np.flatnonzero(w[i])) - {i} == set(topo.neighbours(i))


def test_ring_torus_complete_weights():
    r = ring(8)
    check_mixing(r)
    assert r.neighbours(0) == (1, 7) and r.weight(3, 3) == pytest.approx(1 / 3) and r.weight(3, 4) == pytest.approx(1 / 3)
    t = torus(9)
    check_mixing(t)
    assert t.neighbours(4) == (1, 3, 5, 7) and t.neighbours(0) == (1, 2, 3, 6)
    assert np.allclose(t.weights[t.weights > 0], 1 / 5)
    c = complete(5)
    check_mixing(c)
    assert np.allclose(c.weights, 1 / 5)


def test_small_and_user_graphs():
    assert np.allclose(ring(2).weights, 0.5)     # one edge, counted once
    assert np.allclose(ring(1).weights, 1.0)
    check_mixing(torus(8))                        # 2x4: the two vertical neighbours coincide
    star = topology("0-1,0-2,0-3", 4)             # Metropolis: 1/(1 + max(deg i, deg j)) = 1/4
    check_mixing(star)
    assert star.weight(0, 1) == pytest.approx(0.25) and star.weight(1, 1) == pytest.approx(0.75)
    assert star.weight(0, 0) == pytest.approx(0.25)
    assert topology([(0, 1), (1, 2)], 3).neighbours(1) == (0, 2)
    assert ring(4).spectral_gap() > 0 and complete(4).spectral_gap() == pytest.approx(1.0)


def test_bad_graphs_name_the_cause():
    with pytest.raises(ValueError, match=r"not connected \(ranks \[2, 3\]"):
        Topology(4, [(0, 1), (2, 3)])
    with pytest.raises(ValueError, match="outside"):
        topology("0-5", 4)
    with pytest.raises(ValueError, match="unknown graph topology 'star'"):
        topology("star", 4)
    with pytest.raises(ValueError, match="has 4 workers but the job has 5"):
        topology(ring(4), 5)
    with pytest.raises(ValueError, match="'0-x'"):
        topology("0-1,0-x", 4)
