"""bps_gc.compress: BytePS-compatible gradient codecs over numpy arrays.

Pure functions of arrays plus small stateful objects (one per tensor partition); no framework
is needed, so servers run them with numpy alone. See docs/codecs.md for the wire formats.
"""
from . import dithering, feedback, onebit, sparse  # noqa: F401  (registers the built-ins)
from . import dgc, powersgd, quantize, signs, threshold  # noqa: F401  (issue 11 codecs)
from . import thc  # noqa: F401  (issue 35: summable codes)
from . import outer  # noqa: F401  (issue 44: DiLoCo's outer step on the servers)
from . import identity  # noqa: F401  (issue 44: dense tensors through a servers' reducer)
from .base import Codec
from .chain import build_chain
from . import entire_model  # noqa: F401  (registers the entiremodel partition codec with build_chain)
from .context import step_context
from .params import CompressionParams, ParamError
from .reducers import REDUCERS, choose_reducer, make_reducer, register_reducer
from .scratch import Scratch, use_scratch
from .seeds import derive_seed
from .registry import (load_plugins, register_compressor, register_error_feedback,
                       register_momentum)
from .sparse import resolve_k
from .stateful import StateError, StateGroup
from .state_bytes import decode_state, encode_state

__all__ = ["Codec", "CompressionParams", "ParamError", "REDUCERS", "build_chain",
           "choose_reducer", "derive_seed", "Scratch", "use_scratch", "load_plugins", "make_reducer", "register_compressor",
           "register_error_feedback", "register_momentum", "register_reducer", "resolve_k",
           "step_context", "StateError", "StateGroup", "decode_state", "encode_state"]
