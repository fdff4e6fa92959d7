"""Which torch.distributed backend a job's ranks use, from plain facts about the host (so tests
give it any device count): NCCL for CUDA tensors where each local rank has a GPU of its own, gloo
where several local ranks share one (NCCL refuses two ranks of a communicator on one device:
"Duplicate GPU detected") or where there is no GPU. gloo reduces CUDA tensors too, through host
memory. Every host of a job is assumed alike (the same ranks per host and GPUs)."""

NCCL = "cpu:gloo,cuda:nccl"
SHARED = "NCCL refuses two ranks on one device"


def backend_for_devices(cuda_available, nccl_available, device_count, local_size):
    """(backend, why): the backend string for init_process_group and one line saying why."""
    if not cuda_available or device_count < 1:
        return "gloo", "no CUDA device: gloo"
    if not nccl_available:
        return "gloo", "this torch has no NCCL: gloo, CUDA tensors through host memory"
    if local_size > device_count:
        return "gloo", (f"{local_size} local ranks share {device_count} GPU(s) and {SHARED}: gloo for every "
                        "tensor (CUDA ones through host memory)")
    return NCCL, (f"{local_size} local rank(s), {device_count} GPU(s): NCCL for CUDA tensors, "
                  "gloo for host arrays")
