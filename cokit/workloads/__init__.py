"""The demo's workload: a character-level text corpus (the Python standard library's own
sources, or its prose and C headers) and a small causal transformer. Deterministic from
seeds, nothing downloaded. ``cokit demo`` trains it and ``cokit plan --model`` sizes its
presets; the validation study's other workloads (digits MLP, CNN and autoencoder) are part of
a source checkout (``cokit.bench.study``)."""

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
