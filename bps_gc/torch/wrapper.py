"""What every bps_gc optimizer that wraps a local torch optimizer shares: it is a
torch.optim.Optimizer whose param_groups and state are the wrapped one's (so learning-rate
schedulers and checkpoints see the wrapped optimizer; its state_dict() adds the codec state
under "bps_gc"), and it delegates the rest."""
import torch

from .checkpoint import load_with_codec_state, with_codec_state


class WrappingOptimizer(torch.optim.Optimizer):
    def _wrap(self, optimizer):
        self.optimizer = optimizer
        self.param_groups, self.state, self.defaults = optimizer.param_groups, optimizer.state, optimizer.defaults

    def zero_grad(self, set_to_none=True):
        return self.optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self):
        """The wrapped optimizer's state, and this rank's codec state under "bps_gc"."""
        return with_codec_state(self.optimizer.state_dict())

    def load_state_dict(self, state_dict):
        return load_with_codec_state(state_dict, self.optimizer.load_state_dict)
