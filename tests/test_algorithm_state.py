"""State of the algorithms in bps_gc/algorithms: CHOCO-SGD's copies and codecs, D-PSGD's round
count, the momentum plan's post-pull adapters. K nodes in one process over an in-process
mailbox; N rounds straight equal N/2, save every node, encode, decode, FRESH nodes from the
models at N/2, load, N/2 more: the models and every message byte for byte."""
import numpy as np
import pytest

from bps_gc.algorithms.gossip import ChocoGossip, DPSGDGossip
from bps_gc.algorithms.momentum import MomentumPlan, PostPull
from bps_gc.algorithms.topology import ring
from bps_gc.compress.stateful import StateError
from bps_gc.compress.state_bytes import decode_state, encode_state
from mailbox import Mailbox, in_threads

K, ROUNDS = 4, 6
SHAPES = {"w": 40, "b": 7}


def models(seed=0):
    rng = np.random.default_rng(seed)
    return [{n: rng.standard_normal(size).astype(np.float32) for n, size in SHAPES.items()}
            for _ in range(K)]


def gradient(rank, step, name):
    return np.random.default_rng(1000 * step + 10 * rank + len(name)).standard_normal(
        SHAPES[name]).astype(np.float32)


def make(algorithm, arrays, box, params):
    if algorithm == "choco":
        return [ChocoGossip(arrays[r], ring(K), box.node(r, K), 0.4, params) for r in range(K)]
    return [DPSGDGossip(arrays[r], ring(K), box.node(r, K)) for r in range(K)]


def rounds(nodes, arrays, first, count):
    """Local SGD step then a gossip round on every node (threads: D-PSGD waits for all)."""
    for step in range(first, first + count):
        for r in range(K):
            for name, x in arrays[r].items():
                x -= np.float32(0.1) * gradient(r, step, name)
        in_threads([lambda n=n: n.step(0.1) for n in nodes])
    return [{n: x.copy() for n, x in a.items()} for a in arrays]


@pytest.mark.parametrize("algorithm,params", [
    ("choco", {"compressor": "topk", "k": 0.25}), ("choco", {"compressor": "randomk", "k": 0.25}),
    ("choco", {"compressor": "dithering", "k": 4}), ("choco", None), ("dpsgd", None)])
def test_gossip_resume_equals_straight(algorithm, params):
    straight_box, arrays = Mailbox(), models()
    straight = make(algorithm, arrays, straight_box, params)
    want = rounds(straight, arrays, 0, ROUNDS)
    want_states = [n.state_dict() for n in straight]  # also waits for the last sends
    half = ROUNDS // 2

    box, arrays = Mailbox(), models()
    nodes = make(algorithm, arrays, box, params)
    rounds(nodes, arrays, 0, half)
    saved = [encode_state(n.state_dict()) for n in nodes]  # each rank's own state
    sent_before = [list(box.log[r]) for r in range(K)]
    checkpoint = [{n: x.copy() for n, x in a.items()} for a in arrays]  # the user's models

    resumed_box, arrays = Mailbox(), checkpoint
    fresh = make(algorithm, arrays, resumed_box, params)
    for node, data in zip(fresh, saved):
        node.load_state_dict(decode_state(data))
    got = rounds(fresh, arrays, half, ROUNDS - half)
    got_states = [n.state_dict() for n in fresh]
    for r in range(K):
        for name in SHAPES:
            assert got[r][name].tobytes() == want[r][name].tobytes(), (r, name)
        # every message after the restart is the straight run's, and so is the final state
        assert sent_before[r] + resumed_box.log[r] == straight_box.log[r], r
        assert sorted(got_states[r]) == sorted(want_states[r])
        for key, value in want_states[r].items():
            assert np.asarray(got_states[r][key]).tobytes() == np.asarray(value).tobytes(), key
    if algorithm == "choco":
        sd = decode_state(saved[0])
        assert sd["rounds"] == half and np.any(sd["xhat.w"]) and np.any(sd["u.b"])


def test_gossip_refusals():
    box = Mailbox()
    arrays = models()
    nodes = make("choco", arrays, box, {"compressor": "topk", "k": 0.25})
    sd = nodes[1].state_dict()
    with pytest.raises(StateError, match="setting 'rank' is 1 in the state, 0 here"):
        nodes[0].load_state_dict(sd)
    other = ChocoGossip(models()[1], ring(K), Mailbox().node(1, K), 0.5, {"compressor": "topk", "k": 0.25})
    with pytest.raises(StateError, match="setting 'gamma' is 0.4 in the state, 0.5 here"):
        other.load_state_dict(sd)
    smaller = {"w": np.zeros(40, np.float32), "b": np.zeros(6, np.float32)}
    with pytest.raises(StateError, match="'models'"):
        ChocoGossip(smaller, ring(K), Mailbox().node(1, K), 0.4, {"compressor": "topk", "k": 0.25}
                    ).load_state_dict(sd)
    with pytest.raises(StateError, match="'rounds': expected int, got float 2.5"):
        nodes[1].load_state_dict({**sd, "rounds": 2.5})
    dpsgd = DPSGDGossip(models()[1], ring(K), Mailbox().node(1, K))
    with pytest.raises(StateError, match="'algorithm' is 'choco' in the state, 'dpsgd' here"):
        dpsgd.load_state_dict(sd)


@pytest.mark.parametrize("wd_rule,compressed", [(None, False), ("onebit", True), ("onebit", False),
                                                ("dgc", True), ("dgc", False)])
def test_post_pull_resumes(wd_rule, compressed):
    rng = np.random.default_rng(4)
    steps = [(rng.standard_normal((3, 5)).astype(np.float32),
              rng.standard_normal((3, 5)).astype(np.float32)) for _ in range(6)]

    def apply(adapter, part):
        return [adapter(g.copy(), x).tobytes() for g, x in part]
    want = apply(PostPull((3, 5), np.float32, 0.9, 1e-4, compressed, wd_rule), steps)
    first = PostPull((3, 5), np.float32, 0.9, 1e-4, compressed, wd_rule)
    got = apply(first, steps[:3])
    fresh = PostPull((3, 5), np.float32, 0.9, 1e-4, compressed, wd_rule)
    fresh.load_state_dict(decode_state(encode_state(first.state_dict())))
    assert got + apply(fresh, steps[3:]) == want
    other = PostPull((3, 5), np.float32, 0.8, 1e-4, compressed, wd_rule)
    with pytest.raises(StateError, match="'mu' is '0.9' in the state, '0.8' here"):
        other.load_state_dict(first.state_dict())


def test_momentum_plan_identity():
    plan = MomentumPlan({"compressor": "onebit", "momentum": "nesterov"}, 0.9, 1e-4)
    sd = decode_state(encode_state(plan.state_dict()))
    MomentumPlan({"compressor": "onebit", "momentum": "nesterov"}, 0.9, 1e-4).load_state_dict(sd)
    with pytest.raises(StateError, match="'wd' is 0.0001 in the state, 0.0005 here"):
        MomentumPlan({"compressor": "onebit", "momentum": "nesterov"}, 0.9, 5e-4).load_state_dict(sd)
