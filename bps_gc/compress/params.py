"""One validated, immutable description of how a tensor is compressed.

Built from the friendly ``compression_params`` keys or from BytePS's ``byteps_*`` string
kwargs; serialized as JSON (never pickle) so a worker can declare it to a server.
"""
import dataclasses
import json
import math
from typing import Optional

from ..config import SettingError
from ..wire.wire import json_object
from .registry import COMPRESSORS, ERROR_FEEDBACKS, MOMENTUMS, OPTIONS, load_plugins

PARTITIONS = ("linear", "natural")
GRANULARITIES = ("layerwise", "entiremodel")  # algorithms.md section 3; see compress/entire_model.py
NORMALIZES = ("max", "l2")
NEEDS_K = ("topk", "randomk", "dithering", "dgc")
FRIENDLY_KEYS = ("compressor", "ef", "momentum", "scaling", "k", "seed", "partition",
                 "normalize", "mu", "fp16", "granularity")
# BytePS kwarg -> friendly key. BytePS passed every value as a string.
BYTEPS_KEYS = {
    "byteps_compressor_type": "compressor", "byteps_ef_type": "ef",
    "byteps_error_feedback_type": "ef", "byteps_momentum_type": "momentum",
    "byteps_compressor_onebit_scaling": "scaling", "byteps_compressor_k": "k",
    "byteps_seed": "seed", "byteps_dithering_partition": "partition",
    "byteps_dithering_normalize": "normalize", "byteps_momentum_mu": "mu",
}
BYTEPS_SUFFIXES = {"compressor": "_compressor", "ef": "_ef", "momentum": "_momentum"}


def _bool(value):
    if value not in (True, False):  # also admits 0 and 1
        raise ValueError("must be true or false")
    return bool(value)


def _whole(lo, hi):
    def convert(value):
        if isinstance(value, bool) or not isinstance(value, (int, float)) \
                or not math.isfinite(value) or value != int(value) or not lo <= value <= hi:
            raise ValueError(f"must be a whole number in [{lo}, {hi}]")
        return int(value)
    return convert


def _real(lo, hi, lo_open=False):
    def convert(value):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                or not (lo < value if lo_open else lo <= value) or not value <= hi:
            raise ValueError(f"must be a finite number in {'(' if lo_open else '['}{lo}, {hi}]")
        return float(value)
    return convert


def _one_of(*allowed):
    def convert(value):
        if isinstance(value, bool) or value not in allowed:
            raise ValueError(f"must be one of {', '.join(map(str, allowed))}")
        return int(value)
    return convert


def _densities(value):
    if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
        raise ValueError("must be a list of kept fractions in (0, 1], one per warm-up epoch")
    out = tuple(_real(0, 1, lo_open=True)(v) for v in value)
    if not out:
        raise ValueError("must list at least one density")
    return out


# Keys of the codecs beyond BytePS's (issue 11), passed to register_compressor as its options.
CODEC_OPTIONS = {
    "terngrad": {"clip": _bool},
    "qsgd": {"levels": _whole(1, 2**24 - 1), "biased": _bool},
    "threshold": {"threshold": _real(0, math.inf)},
    "dgc": {"sample_ratio": _real(0, 1, lo_open=True), "warmup_epochs": _whole(0, 10**6),
            "warmup_densities": _densities, "fp16_values": _bool,
            "clip_norm": _real(0, math.inf, lo_open=True), "momentum_masking": _bool},
    "powersgd": {"rank": _whole(1, 4096)},
    "thc": {"bits": _one_of(2, 4, 8), "rotate": _bool, "feedback": _bool},
}
REQUIRED_OPTIONS = {"threshold": ("threshold",)}
# these carry their own error feedback (DGC's accumulation, PowerSGD's residual)
OWN_ERROR_FEEDBACK = ("dgc", "powersgd", "thc")  # thc: its option 'feedback'
# compressors whose later phases bypass a momentum decorator (the optimizer keeps momentum)
PHASED = ("powersgd", "thc")


class ParamError(SettingError):
    """A compression parameter is wrong; the message names the key (``key``) and what is allowed."""

    key = property(lambda self: self.name)

    def __init__(self, key, message):
        super().__init__(key, message, label=f"compression parameter {key!r}")


@dataclasses.dataclass(frozen=True)
class CompressionParams:
    compressor: Optional[str] = None
    ef: Optional[str] = None
    momentum: Optional[str] = None
    scaling: bool = False
    k: Optional[float] = None
    seed: Optional[int] = None
    partition: str = "linear"
    normalize: str = "max"
    mu: Optional[float] = None
    fp16: bool = False
    granularity: str = "layerwise"
    options: tuple = ()  # sorted (key, value) pairs a plugin compressor declared

    @property
    def compressed(self):
        return self.compressor is not None

    @property
    def raw_when_small(self):
        """Whether a tensor under BYTEPS_MIN_COMPRESS_BYTES goes uncompressed: its compressor
        class's ``raw_when_small`` (False for ``identity``, which saves no bytes)."""
        load_plugins()
        return getattr(COMPRESSORS.get(self.compressor), "raw_when_small", True)

    def option(self, key):
        return dict(self.options)[key]

    def to_dict(self):
        """The non-default settings as friendly keys (what ``from_dict`` takes back)."""
        out = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name != "options" and value != f.default:
                out[f.name] = value
        out.update(dict(self.options))
        return out

    def to_json(self) -> bytes:
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, data):
        return cls.from_dict(json_object(data, "compression parameters", ValueError))

    @classmethod
    def from_dict(cls, params=None, **kwargs):
        """Validate friendly keys (``compression_params``) and/or ``byteps_*`` kwargs."""
        raw = dict(params or {}, **kwargs)
        friendly, source = {}, {}
        for key, value in raw.items():
            name = BYTEPS_KEYS.get(key, key)
            if key in BYTEPS_KEYS:
                value = _from_byteps_string(key, name, value)
            if name in friendly:
                raise ParamError(key, f"sets {name!r}, which {source[name]!r} already set")
            friendly[name], source[name] = value, key
        return _validate(friendly)


def _from_byteps_string(key, name, value):
    if not isinstance(value, str):
        return value
    text = value.strip()
    if name in BYTEPS_SUFFIXES and text.endswith(BYTEPS_SUFFIXES[name]):
        return text[: -len(BYTEPS_SUFFIXES[name])]
    if name == "scaling":
        if text.lower() in ("true", "1"):
            return True
        if text.lower() in ("false", "0"):
            return False
        raise ParamError(key, f"must be 'true' or 'false', got {value!r}")
    if name == "partition" and text in ("0", "1"):
        return PARTITIONS[int(text)]
    if name == "normalize" and text in ("0", "1"):
        return NORMALIZES[int(text)]
    if name in ("k", "mu"):
        try:
            return float(text)
        except ValueError:
            raise ParamError(key, f"must be a number, got {value!r}") from None
    if name == "seed":
        try:
            return int(text)
        except ValueError:
            raise ParamError(key, f"must be an integer, got {value!r}") from None
    return text


def _choice(raw, key, table, kind):
    value = raw.get(key)
    if value is None:
        return None
    if not isinstance(value, str) or value not in table:
        raise ParamError(key, f"unknown {kind} {value!r}; allowed: {', '.join(sorted(table))}")
    return value


def _number(raw, key):
    value = raw.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ParamError(key, f"must be a finite number, got {value!r}")
    return value


def _flag(raw, key):
    value = raw.get(key, False)
    if value not in (True, False):  # also admits 0 and 1
        raise ParamError(key, f"must be true or false, got {value!r}")
    return bool(value)


def _validate(raw):
    load_plugins()
    compressor = _choice(raw, "compressor", COMPRESSORS, "compressor")
    options = OPTIONS.get(compressor, {})
    unknown = sorted(set(raw) - set(FRIENDLY_KEYS) - set(options))
    if unknown:
        raise ParamError(unknown[0], f"unknown key; allowed: {', '.join(FRIENDLY_KEYS + tuple(options))}")
    ef = _choice(raw, "ef", ERROR_FEEDBACKS, "error feedback")
    momentum = _choice(raw, "momentum", MOMENTUMS, "momentum")
    for key, value in (("ef", ef), ("momentum", momentum)):
        if value is not None and compressor is None:
            raise ParamError(key, f"{value!r} needs a compressor; set 'compressor' too")
    partition = raw.get("partition", "linear")
    if partition not in PARTITIONS:
        raise ParamError("partition", f"unknown {partition!r}; allowed: {', '.join(PARTITIONS)}")
    normalize = raw.get("normalize", "max")
    if normalize not in NORMALIZES:
        raise ParamError("normalize", f"unknown {normalize!r}; allowed: {', '.join(NORMALIZES)}")
    granularity = raw.get("granularity", "layerwise")
    if granularity not in GRANULARITIES:
        raise ParamError("granularity", f"unknown {granularity!r}; allowed: {', '.join(GRANULARITIES)}")
    if granularity != "layerwise" and compressor is None:
        raise ParamError("granularity", f"{granularity!r} needs a compressor; set 'compressor' too")
    k = _validate_k(compressor, _number(raw, "k"), partition)
    seed = raw.get("seed")
    if seed is not None:
        if isinstance(seed, bool) or not isinstance(seed, int) or not 0 < seed < 2**64:
            raise ParamError("seed", f"must be an integer in [1, 2**64), got {seed!r} "
                             "(0 would make the xorshift128+ generator emit only zeros)")
    mu = _number(raw, "mu")
    if mu is not None and not 0 <= mu < 1:
        raise ParamError("mu", f"momentum factor must be in [0, 1), got {mu!r}")
    if momentum is not None and mu is None:
        raise ParamError("momentum", f"{momentum!r} needs 'mu' (the optimizer's momentum)")
    extra = []
    for key, convert in sorted(options.items()):
        if key in raw:
            try:
                extra.append((key, convert(raw[key])))
            except (TypeError, ValueError) as e:
                raise ParamError(key, f"bad value {raw[key]!r}: {e}") from None
    for key in REQUIRED_OPTIONS.get(compressor, ()):
        if key not in raw:
            raise ParamError(key, f"{compressor} needs {key!r}")
    if "warmup_epochs" in raw and "warmup_densities" in raw:
        raise ParamError("warmup_densities", "give either 'warmup_epochs' or 'warmup_densities'")
    if ef is not None and compressor in OWN_ERROR_FEEDBACK:
        raise ParamError("ef", f"{compressor} has its own error feedback; remove 'ef'")
    if momentum is not None and compressor in PHASED:  # its later phases bypass a decorator
        raise ParamError("momentum", f"{compressor} keeps the momentum in the optimizer; remove 'momentum'")
    if compressor == "thc" and raw.get("bits") == 2 and raw.get("rotate") and raw.get("feedback"):
        # 2-bit codes err by up to s/3 a rotated coordinate, and rotating back gathers those
        # errors into the residual faster than the scale shrinks: it grows (docs/codecs.md)
        raise ParamError("feedback", "thc: 2-bit rotated codes with 'feedback' diverge (the residual "
                         "grows each step); use bits 4 or 8, or drop 'rotate' or 'feedback'")
    return CompressionParams(compressor=compressor, ef=ef, momentum=momentum,
                             scaling=_flag(raw, "scaling"), k=k, seed=seed, partition=partition,
                             normalize=normalize, mu=None if mu is None else float(mu),
                             fp16=_flag(raw, "fp16"), granularity=granularity, options=tuple(extra))


def _validate_k(compressor, k, partition):
    if k is None:
        if compressor in NEEDS_K:
            raise ParamError("k", f"{compressor} needs k (fraction < 1 or count >= 1 for "
                             "topk/randomk, number of levels for dithering)")
        return None
    if k <= 0:
        raise ParamError("k", f"must be > 0, got {k!r}")
    if compressor == "dithering":
        if k != int(k):
            raise ParamError("k", f"dithering levels must be a whole number >= 1, got {k!r}")
        limit = 31 if partition == "natural" else 2**24
        if k > limit:
            raise ParamError("k", f"at most {limit} levels for {partition} dithering, got {k!r}")
        return int(k)
    if k >= 1:
        if k != int(k):
            raise ParamError("k", f"k >= 1 is a count per partition and must be whole, got {k!r}")
        return int(k)
    return float(k)
