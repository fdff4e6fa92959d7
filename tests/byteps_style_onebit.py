"""A BytePS-style MXNet compression test (the way BytePS's tests/test_onebit.py is written;
our own code): a gluoncv model, ``DistributedTrainer`` with ``compression_params``, and a numpy
re-computation of the codec checked after every step. Run it on a cluster, e.g.
``bpslaunch --local --workers 2 --servers 1 -- python tests/byteps_style_onebit.py``
(tests/test_gluoncv.py does). The only bps_gc-specific line is the import.

Every rank computes every rank's gradient itself (the parameters are the same everywhere and
each rank's data comes from ``RandomState(rank)``), so each can replay the whole round: the
workers' onebit, the server's rank-ordered sum and its onebit again, then plain SGD.
"""
import os
import unittest

import mxnet as mx
import numpy as np
from mxnet import autograd, gluon, nd

import bps_gc.mxnet as bps
from gluoncv.model_zoo import get_model  # after bps_gc.mxnet: works beside torch >= 2

STEPS, BATCH, LR = 3, 4, 0.1


def onebit(x, scaling):
    """BytePS's onebit, decoded: sign (0 counts as +) times mean |x| (float64 sum) or 1."""
    scale = np.float32(np.abs(x.astype(np.float64)).sum() / x.size) if scaling else np.float32(1)
    return np.where(x < 0, -scale, scale).astype(np.float32)


def fake_batch(rank, step):
    rng = np.random.RandomState(1000 * rank + step)
    return (nd.array(rng.rand(BATCH, 3, 8, 8).astype(np.float32)),
            nd.array(rng.randint(0, 10, BATCH).astype(np.float32)))


class OnebitTestCase(unittest.TestCase):
    def test_onebit(self, scaling=True):
        bps.init()
        size = bps.size()
        min_compress = int(os.environ.get("BYTEPS_MIN_COMPRESS_BYTES", 65536))
        mx.random.seed(2020)
        net = get_model("cifar_resnet20_v1", classes=10)
        net.initialize(mx.init.Xavier(), ctx=mx.cpu())
        net(nd.ones((1, 3, 8, 8)))  # ends deferred initialization
        optimizer_params = {"learning_rate": LR, "momentum": 0.0, "wd": 0.0}
        compression_params = {"compressor": "onebit", "scaling": scaling}
        trainer = bps.DistributedTrainer(net.collect_params(), "sgd", optimizer_params,
                                         compression_params=compression_params)
        loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
        trained = [p for p in trainer._params if p.grad_req != "null"]
        bps.broadcast_parameters(net.collect_params(), root_rank=0)
        params = [p.data().asnumpy() for p in trained]
        compressed = 0
        for step in range(STEPS):
            grads = []  # grads[rank][i], our own batch last: trainer.step sees it
            for rank in [r for r in range(size) if r != bps.rank()] + [bps.rank()]:
                data, label = fake_batch(rank, step)
                with autograd.record():
                    loss = loss_fn(net(data), label)
                loss.backward()
                grads.append((rank, [p.grad().asnumpy() for p in trained]))
            grads = [g for _, g in sorted(grads, key=lambda rank_grads: rank_grads[0])]
            trainer.step(BATCH)
            scale = np.float32(1.0 / (BATCH * size))
            for i, param in enumerate(trained):
                gs = [grads[r][i] * scale for r in range(size)]
                if gs[0].nbytes >= min_compress:  # workers compress, the server sums and recompresses
                    c = sum(onebit(g, scaling) for g in gs)
                    c = onebit(c, scaling)
                    compressed += 1
                else:
                    c = sum(gs)
                params[i] = params[i] - np.float32(LR) * c
        self.assertGreater(compressed, 0)
        failures = []
        for i, param in enumerate(trained):
            x = param.data().asnumpy()
            if not np.allclose(params[i], x, rtol=0, atol=4 * np.finfo(np.float32).eps):
                failures.append(f"{param.name}: max diff {np.abs(params[i] - x).max():.3g}")
        self.assertEqual(failures, [], f"rank {bps.rank()}")
        print(f"rank {bps.rank()}: {len(trained)} parameters, {compressed // STEPS} compressed, "
              f"{STEPS} steps as the numpy re-computation")
        bps.shutdown()


if __name__ == "__main__":
    unittest.main()
