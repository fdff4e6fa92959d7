"""CHOCO-SGD and D-PSGD (bps_gc.torch.DecentralizedOptimizer) with K nodes in one process,
their messages carried by an in-process mailbox. The oracle is a numpy re-computation of
spec §5 in matrix form (S = W @ Xhat, not the nodes' incremental s). The same optimizer runs
on real processes in test_choco_cluster.py."""

import numpy as np
import pytest

from bps_gc.algorithms.topology import ring, topology, torus
from bps_gc.compress import CompressionParams, build_chain
from mailbox import Mailbox, in_threads

torch = pytest.importorskip("torch")
import bps_gc.torch.choco as choco  # noqa: E402


def make_nodes(size, topo, algorithm="choco", gamma=0.45, params=None, lr=0.1, shape=(4, 4)):
    box = Mailbox()
    nodes = []
    for r in range(size):
        torch.manual_seed(100 + r)  # different initial models
        model = torch.nn.Linear(shape[1], shape[0])
        opt = torch.optim.SGD(model.parameters(), lr=lr)
        opt = choco.DecentralizedOptimizer(opt, model.named_parameters(), algorithm=algorithm, topology=topo,
                                           consensus_stepsize=gamma, compression_params=params,
                                           communicator=box.node(r, size))
        nodes.append((model, opt))
    return nodes, box


def flat(model):
    return np.concatenate([p.detach().numpy().ravel() for _, p in sorted(model.named_parameters())])


def round_of(nodes, grads=None):
    """One step on every node, each in its own thread (D-PSGD waits for its neighbours)."""
    def node_step(r, model, opt):
        for k, p in enumerate(p for _, p in sorted(model.named_parameters())):
            p.grad = torch.zeros_like(p) if grads is None else torch.from_numpy(grads(r, k, p.shape))
        opt.step()
    in_threads([lambda r=r, m=m, o=o: node_step(r, m, o) for r, (m, o) in enumerate(nodes)])


CODECS = {  # (Q, consensus step size that converges for it on these tiny tensors)
    "signnorm": ({"compressor": "signnorm"}, 0.2),
    "topk": ({"compressor": "topk", "k": 1}, 0.05),
    "qsgd": ({"compressor": "qsgd", "levels": 4}, 0.3),
}


@pytest.mark.parametrize("codec", sorted(CODECS))
def test_zero_gradients_reach_the_initial_average_geometrically(codec):
    params, gamma = CODECS[codec]
    nodes, _ = make_nodes(4, "ring", gamma=gamma, params=params)
    x0 = np.stack([flat(m) for m, _ in nodes])
    mean0, err0 = x0.mean(0), np.abs(x0 - x0.mean(0)).max()
    errors, mean, ulp = [], mean0, np.finfo(np.float32).eps * np.abs(x0).max()
    for t in range(600):
        round_of(nodes)
        x = np.stack([flat(m) for m, _ in nodes])
        # the average of the x_i is kept at every step, up to a few float32 roundings of the
        # model's values (their random walk over 600 steps stays far below the spread)
        assert np.abs(x.mean(0) - mean).max() <= 16 * ulp, f"step {t}"
        mean = x.mean(0)
        errors.append(np.abs(x - mean0).max())
    assert np.abs(mean - mean0).max() <= 1e-5 * err0
    # geometric: at least 10x closer every 100 rounds until float32 noise
    for t in range(100, 600, 100):
        assert errors[t] <= max(0.1 * errors[t - 100], 1e-5 * err0), (codec, t, errors[t - 100], errors[t])
    assert errors[-1] <= 1e-5 * err0


def oracle_choco(x0, w, gamma, params, lr_grads, steps, tensors):
    """Spec §5 for all nodes at once: X -= lr*G; X += gamma (W Xhat - Xhat); Xhat += Q(X - Xhat),
    Q applied to each tensor's slice of the flat model (``tensors``: slices)."""
    x, xhat = x0.astype(np.float32).copy(), np.zeros_like(x0, np.float32)
    codecs = [build_chain(CompressionParams.from_dict(params), sl.stop - sl.start, np.float32) for sl in tensors]
    history = []
    for t in range(steps):
        x -= lr_grads(t)
        x += np.float32(gamma) * ((w @ xhat.astype(np.float64)).astype(np.float32) - xhat)
        for i in range(x.shape[0]):
            for sl, codec in zip(tensors, codecs):
                xhat[i, sl] += codec.decompress(codec.compress(x[i, sl] - xhat[i, sl], 0.1))
        history.append(x.copy())
    return history


@pytest.mark.parametrize("graph,size", [("ring", 4), ("torus", 9), ("0-1,1-2,2-3,3-0,0-2,4-0", 5)])
def test_choco_matches_the_oracle_on_graphs(graph, size):
    # one 24-element tensor per node (a bias-free Linear), deterministic Q (top-k), real gradients
    params, gamma, lr = {"compressor": "topk", "k": 3}, 0.3, 0.05
    nodes, box = make_nodes(size, graph, gamma=gamma, params=params, lr=lr, shape=(6, 4))
    x0 = np.stack([flat(m) for m, _ in nodes])
    rng = np.random.default_rng(3)
    grads = rng.standard_normal((30, size, 6 + 6 * 4)).astype(np.float32)  # bias, weight (sorted)
    w = topology(graph, size).weights
    want = oracle_choco(x0, w, gamma, params, lambda t: np.float32(lr) * grads[t], 30,
                        [slice(0, 6), slice(6, 30)])
    for t in range(30):
        round_of(nodes, lambda r, k, shape: grads[t, r, 6:].reshape(shape) if k == 1 else grads[t, r, :6])
        got = np.stack([flat(m) for m, _ in nodes])
        assert np.allclose(got, want[t], atol=2e-5), (graph, t, np.abs(got - want[t]).max())
    for _, opt in nodes:
        opt.finish()
    # bytes: 2 tensors x (3 top-k records of 8 bytes) + 12-byte header, per neighbour per round
    degrees = sum(len(topology(graph, size).neighbours(r)) for r in range(size))
    assert box.sent == 30 * degrees * (12 + 2 * 3 * 8)


def test_dpsgd_is_neighbour_averaging():
    nodes, _ = make_nodes(4, "ring", algorithm="dpsgd", gamma=1.0)
    x = np.stack([flat(m) for m, _ in nodes])
    w = ring(4).weights
    for t in range(5):
        round_of(nodes)
        x = (w @ x.astype(np.float64)).astype(np.float32)
        got = np.stack([flat(m) for m, _ in nodes])
        assert np.allclose(got, x, atol=1e-6), t


def test_choco_without_compression_and_gamma_one_is_dpsgd_a_round_late():
    # identity Q, gamma = 1: xhat_i is last round's x_i and s_i = sum_j w_ij xhat_j, so CHOCO's
    # round t+1 mixes what D-PSGD mixes in round t
    a, _ = make_nodes(4, torus(4), gamma=1.0)
    b, _ = make_nodes(4, torus(4), algorithm="dpsgd")
    round_of(a)
    for t in range(6):
        round_of(a)
        round_of(b)
        for (ma, _), (mb, _) in zip(a, b):
            assert np.allclose(flat(ma), flat(mb), atol=1e-6), t


def test_user_errors_name_their_cause():
    with pytest.raises(ValueError, match="consensus step size must be in"):
        make_nodes(2, "ring", gamma=0.0)
    with pytest.raises(ValueError, match="no error feedback"):
        make_nodes(2, "ring", params={"compressor": "topk", "k": 1, "ef": "vanilla"})
    with pytest.raises(ValueError, match="has 4 workers but the job has 2"):
        make_nodes(2, ring(4))
    with pytest.raises(ValueError, match="D-PSGD exchanges uncompressed"):
        make_nodes(2, "ring", algorithm="dpsgd", params={"compressor": "topk", "k": 1})
