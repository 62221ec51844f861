"""Compressed gradient exchange: the DeMo, SparseLoCo and Dion optimizers, payload codecs and a DDP comm hook."""

from cokit.compress.dion import Dion
from cokit.compress.inner import Muon
from cokit.compress.optimizer import DeMo
from cokit.compress.payload import PayloadCodec, codec_names, get_codec, register_codec
from cokit.compress.sparseloco import SparseLoCo
from cokit.compress.stats import CommStats, ring_allgather_bytes, ring_allreduce_bytes

__all__ = [
    "CommStats",
    "DeMo",
    "Dion",
    "Muon",
    "PayloadCodec",
    "SparseLoCo",
    "codec_names",
    "get_codec",
    "register_codec",
    "ring_allgather_bytes",
    "ring_allreduce_bytes",
]
