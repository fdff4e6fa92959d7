"""scripts/scale_on_paper.py's message sizes: what each codec's payload and each reducer's reply
weigh, measured by running bps_gc's own chains and reducers on N(0, std) data, and the wire
headers a PUSH and its reply carry. Imported by scale_on_paper.py (which puts the repository on
sys.path first)."""
import json

import numpy as np

from bps_gc import compress
from bps_gc.algorithms.gossip import codec_for, gossip_params
from bps_gc.wire.wire import HEADER, encode_context

GRADIENT_STD = 1e-3  # the gradients' N(0, std) of scripts/bench_common.py
MEASURED_PUSHES = 16  # replies are measured by reducing this many pushes at most
CONTEXT = compress.step_context({"lr": 0.1, "step": 1000, "epoch": 30})  # past any warm-up
PUSH_HEADER = HEADER.size + len(encode_context(CONTEXT))  # a PUSH carries the step context
REPLY_HEADER = HEADER.size  # PUSH_REPLY and PEER headers carry none


class Sizes:
    """Payload and reply bytes from running the codec chains and reducers on N(0, scale) data
    of each size, cached. A reply to P pushes is measured by reducing min(P, measured) pushes of
    independent data; beyond that it is the measured size where it did not grow from 1 push
    to ``measured`` (fixed-size payloads: exact), else extrapolated linearly, capped at dense
    (an upper bound: it assumes the pushes' nonzeros do not overlap)."""

    def __init__(self, measured=MEASURED_PUSHES, seed=0):
        self.measured, self.seed = measured, seed
        self.cache, self.data_cache = {}, {}

    def data(self, n, scale, i):
        key = (n, scale, i)
        if key not in self.data_cache:
            rng = np.random.default_rng([self.seed, n, i])
            self.data_cache[key] = rng.standard_normal(n, dtype=np.float32) * np.float32(scale)
        return self.data_cache[key]

    @staticmethod
    def _params(params):
        return compress.CompressionParams.from_dict(params)

    def payloads(self, params, n, shape, scale, count, key=1):
        """``count`` pushes (each its own worker's chain, one shared seed as in a job)."""
        cache_key = ("payloads", json.dumps(params, sort_keys=True), n, shape, scale, count)
        if cache_key not in self.cache:
            p = self._params(params)
            self.cache[cache_key] = [compress.build_chain(p, n, np.float32, key=key, shape=shape)
                                     .compress(self.data(n, scale, i), CONTEXT) for i in range(count)]
        return self.cache[cache_key]

    def push(self, params, n, shape, scale):
        return int(self.payloads(params, n, shape, scale, 1)[0].nbytes)

    def gossip(self, params, n, shape, scale, key):
        """One tensor's CHOCO Q payload (or D-PSGD's raw floats): algorithms/gossip.codec_for."""
        cache_key = ("gossip", json.dumps(params, sort_keys=True), n, shape, scale)
        if cache_key not in self.cache:
            q = codec_for(gossip_params(params) if params else None, n, np.float32, key)
            self.cache[cache_key] = q.compress(self.data(n, scale, 0), CONTEXT)
        return self.cache[cache_key]

    def reply(self, params, reducer, n, shape, scale, pushes):
        """(reply bytes, how: 'exact' | 'held' | 'bound')."""
        cache_key = ("reply", json.dumps(params, sort_keys=True), reducer, n, shape, scale, pushes)
        if cache_key in self.cache:
            return self.cache[cache_key]
        p = self._params(params)

        def run(count):
            red = compress.make_reducer(reducer, p, n, np.float32, key=1)
            return int(red.reduce(self.payloads(params, n, shape, scale, count), True, CONTEXT).nbytes)
        if pushes <= self.measured:
            result = (run(pushes), "exact")
        else:
            one, many = run(1), run(self.measured)
            if many == one:
                result = (one, "exact" if reducer == "majority" or not variable(params) else "held")
            else:
                cap = n * 4 if reducer == "lossless" else 2 * n * 4  # dense, or n sorted records
                grown = one + (pushes - 1) * (many - one) / (self.measured - 1)
                result = (int(min(cap, max(many, grown))), "bound")
        self.cache[cache_key] = result
        return result


def variable(params):
    """Codecs whose payload size depends on the data (docs/codecs.md)."""
    return params.get("compressor") in ("threshold", "dithering", "dgc", "adaptive_threshold")

