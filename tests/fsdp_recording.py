"""What the FSDP jobs (fsdp_job.py, fsdp_ps_job.py) record of a hooked model, for the tests'
numpy recomputations: every all-reduce hook call's reduce-scatter output before and after, and
every compressed in-host reduce-scatter's input and output."""
import time

import torch
from torch.distributed.fsdp import FSDPModule


def widened(tensor):
    """A copy as numpy: float16 and bfloat16 widened exactly to float32, float64 kept."""
    return tensor.detach().to(torch.float64 if tensor.dtype == torch.float64 else torch.float32).clone().numpy()


def record_calls(model, calls):
    """Wrap every module's hook to record (module index, reduce-scatter output in, out)."""
    for index, module in enumerate(m for m in model.modules() if isinstance(m, FSDPModule)):
        param_group = module._get_fsdp_state()._fsdp_param_groups
        if not param_group:
            continue
        inner = param_group[0]._all_reduce_hook

        def recording(reduce_output, inner=inner, index=index):
            before = widened(reduce_output)
            inner(reduce_output)
            calls.append((index, before, widened(reduce_output)))
        module.set_all_reduce_hook(recording)


class RecordingReduceScatter:
    """A module's reduce-scatter comm, recording (module index, its input, its output, the
    call's wall seconds, the process's CPU seconds in it: every thread's)."""

    def __init__(self, inner, index, calls):
        self.inner, self.index, self.calls = inner, index, calls
        self.allocate = inner.allocate

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        before = widened(input_tensor)  # averaged in place
        wall, cpu = time.perf_counter(), time.process_time()
        self.inner(output_tensor, input_tensor, group, op, async_op)
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        self.calls.append((self.index, before, widened(output_tensor), wall, cpu))


def record_reduce_scatters(model, calls):
    for index, module in enumerate(m for m in model.modules() if isinstance(m, FSDPModule)):
        for param_group in module._get_fsdp_state()._fsdp_param_groups:
            module.set_custom_reduce_scatter(RecordingReduceScatter(param_group._reduce_scatter_comm, index, calls))
