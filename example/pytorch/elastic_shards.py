"""The elastic MNIST example's sampler (train_mnist_elastic.py), in numpy: the training digits
as one stream, a fresh permutation per pass over them (drawn from the seed and the pass), cut
step by step into the members' batches. A membership change deals the REST of the current pass
over the new members: no pass restarts, every digit is dealt once per pass.

Step s's global batch is the stream's next ``dealt * batch`` digits, and a host takes the slot:

  * its place among the members of step s-1 (``previous``: what bps.membership() said before
    the step; a death is only known once the step is summed, so the dead host's slot of that
    step is lost with it, and nobody else takes it);
  * a host joining at step s is not among them: it takes a slot after theirs, in rank order
    among the joiners (``members``: bps.membership() before its first step, the join's epoch).

After the step every live host knows its members and moves the position on by the slots dealt
(the members of step s-1 and the joiners). The state (position, previous members) is the same
on every live host, and a joiner copies it from a live one (the example keeps it in a model
buffer, which bps.elastic_start copies), so the hosts agree with no message of their own.
"""
import numpy as np


class ElasticShards:
    """Batches of ``batch`` indices into ``count`` digits, dealt over the members."""

    def __init__(self, count, batch, seed):
        if batch > count:
            raise ValueError(f"a batch of {batch} digits is more than the {count} there are")
        self.count, self.batch, self.seed = count, batch, seed
        self.cached = (None, None)  # (pass, its permutation)

    def permutation(self, number):
        if self.cached[0] != number:
            self.cached = (number, np.random.default_rng([self.seed, number]).permutation(self.count))
        return self.cached[1]

    def stream(self, start, length):
        """The digits at positions [start, start + length) of the stream of passes."""
        out = []
        while length:
            number, offset = divmod(start, self.count)
            take = min(length, self.count - offset)
            out.append(self.permutation(number)[offset:offset + take])
            start, length = start + take, length - take
        return np.concatenate(out)

    @staticmethod
    def slot(rank, previous, members):
        """``rank``'s slot in this step's global batch (see the module's docstring)."""
        previous = sorted(previous)
        if rank in previous:
            return previous.index(rank)
        joiners = sorted(set(members) - set(previous))
        if rank not in joiners:
            raise ValueError(f"worker {rank} is neither among the last step's members {previous} "
                             f"nor among this step's {sorted(members)}")
        return len(previous) + joiners.index(rank)

    def batch_of(self, position, previous, members, rank):
        """``rank``'s batch of the step that starts at stream ``position``."""
        return self.stream(position + self.slot(rank, previous, members) * self.batch, self.batch)

    def advance(self, position, previous, members):
        """The position after a step dealt over ``previous`` and the joiners among ``members``
        (the step's members, as every live host sees them once it is summed)."""
        return position + len(set(previous) | set(members)) * self.batch
