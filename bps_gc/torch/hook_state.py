"""The DDP hook's codec state per gradient, keyed by parameter (docs/checkpoint.md): each
gradient keeps its chain, reducer and step count when DDP regroups its buckets (after the
first step, or with another ``bucket_cap_mb`` after a restart), and its state is saved under
the parameter's name. Names come from ``comm_hook(..., named_parameters=)``, else from the
order of ``optimizer``'s parameters (``param.<i>``, as torch's optimizer state names them)."""
from .. import compress
from ..compress.state import StateError, StateGroup, Stateful
from .device_codecs import chain_for, device_reduction, uses_device_chain


class GradientCodec(Stateful):
    """One gradient's worker chain and reducer; ``key`` seeds both (the bucket index and
    position where it was first seen), ``steps`` counts its reductions (the step context)."""

    state_attrs = ("key", "steps")

    def __init__(self, key, n, device, on_device, chain, reducer):
        self.key, self.n, self.device, self.on_device = key, n, device, on_device
        self.chain, self.reducer, self.steps = chain, reducer, 0

    def state_children(self):
        return (("worker/", self.chain), ("reducer/", self.reducer))


class HookState:
    """Mixed into CompressionHook (which provides params, reducer, wire_dtype, optimizer,
    ``named``: [(name, parameter)] or None, ``gradients``: {id(parameter) or (bucket index,
    position): GradientCodec} and ``buckets``)."""

    def _gradient_ids(self, bucket, index, count):
        """The ids the gradients of ``bucket`` keep their codecs under: their parameters (DDP's
        buckets), or their bucket index and position (a bucket without parameters())."""
        if hasattr(bucket, "parameters"):
            return [id(p) for p in bucket.parameters()]
        return [(index, position) for position in range(count)]

    def _make_codec(self, key, n, tensor, on_device):
        """A fresh GradientCodec of ``n`` elements where ``tensor`` lives."""
        if on_device:
            chain = chain_for(self.params, n, self.wire_dtype, key, "worker", tensor)
            reducer = device_reduction(self.reducer, self.params, n, self.wire_dtype, key, tensor.device)
        else:
            chain = compress.build_chain(self.params, n, self.wire_dtype, key=key, role="worker")
            reducer = compress.make_reducer(self.reducer, self.params, n, self.wire_dtype, key)
        return GradientCodec(key, n, tensor.device, on_device, chain, reducer)

    def _codec_for(self, gradient, n, buffer, on_device, key):
        """The codec of ``gradient``: its own when it was seen before with this size and device."""
        codec = self.gradients.get(gradient)
        if codec is None or codec.n != n or codec.device != buffer.device or codec.on_device != on_device:
            codec = self.gradients[gradient] = self._make_codec(key, n, buffer, on_device)
        return codec

    def _next_step(self, codecs):
        """The step context's ``step`` of a bucket of ``codecs``: how many times they were reduced."""
        step = max(codec.steps for codec in codecs)
        for codec in codecs:
            codec.steps = step + 1
        return step

    # ------------------------------------------------------------------ checkpoints

    def _named(self):
        """{name: parameter} of the hook's parameters."""
        if self.named is not None:
            return dict(self.named)
        if self.optimizer is None:
            raise StateError("comm_hook: its state is keyed by parameter name; pass "
                             "named_parameters=model.named_parameters() (or optimizer=) to comm_hook")
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        return {f"param.{i}": p for i, p in enumerate(params)}

    def codec_state(self):
        """A Stateful of every gradient's codec, by parameter name."""
        names = {id(p): name for name, p in self._named().items()}
        unnamed = [g for g in self.gradients if g not in names]
        if unnamed:
            raise StateError(f"comm_hook: {len(unnamed)} gradient(s) of its buckets are not among the "
                             "parameters it was given (named_parameters= or optimizer=)")
        return StateGroup({names[g]: codec for g, codec in self.gradients.items()})

    def codec_state_to_load(self, sd):
        """(a Stateful of fresh codecs for the parameters ``sd`` holds, made with their saved
        keys; a function that installs them once loaded). Parameters this model lacks are
        refused, named."""
        named = self._named()
        saved = sorted({key.split("/", 1)[0].removeprefix("identity.") for key in sd})
        unknown = [name for name in saved if name not in named]
        if unknown:
            raise StateError(f"comm_hook: the state holds parameters this model does not have: "
                             f"{', '.join(map(repr, unknown[:5]))}{' ...' if len(unknown) > 5 else ''}")
        fresh = {}
        for name in saved:
            p, key = named[name], sd.get(f"{name}/key")
            if isinstance(key, bool) or not isinstance(key, int) and not hasattr(key, "__index__"):
                raise StateError(f"comm_hook: the state of {name!r} has no integer key")
            fresh[name] = self._make_codec(int(key), p.numel(), p, uses_device_chain(p))

        def install():
            self.gradients.update((id(named[name]), codec) for name, codec in fresh.items())
            self.buckets.clear()  # rebuilt from the installed codecs at the next call
        return StateGroup(fresh), install
