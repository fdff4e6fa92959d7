"""What ``declare`` decided for a tensor (comm/communicator.py): its own module, so that the
partition plan (placement.py), which makes it, and the interface, which returns it, both import it."""
import dataclasses
from typing import Optional


@dataclasses.dataclass(frozen=True)
class Declaration:
    """What ``declare`` decided for a tensor: the public result bindings may rely on."""
    name: str
    shape: Optional[tuple]          # None until the first reduce when declared without a shape
    dtype: Optional[object]         # numpy dtype of the caller's arrays
    params: object                  # compress.CompressionParams
    reducer: str                    # the reducer its reductions use
    compressed: bool                # whether any partition is compressed on the wire
    wire_dtype: Optional[object] = None  # dtype on the wire (float16 with fp16)
