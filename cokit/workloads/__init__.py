"""Training workloads for demos and validation studies: a character-level text corpus and a
small causal transformer. Everything is deterministic from seeds and needs no download."""

from cokit.workloads.model import MODEL_PRESETS, CharTransformer, ModelConfig
from cokit.workloads.text import CharCorpus, CorpusConfig, TextWorkload, TextWorkloadConfig

__all__ = [
    "MODEL_PRESETS",
    "CharCorpus",
    "CharTransformer",
    "CorpusConfig",
    "ModelConfig",
    "TextWorkload",
    "TextWorkloadConfig",
]
