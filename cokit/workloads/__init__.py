"""Training workloads for demos and validation studies: a character-level text corpus and a
small causal transformer, and an MLP, a CNN and a convolutional autoencoder of scikit-learn's
8x8 digits.
Everything is deterministic from seeds and needs no download."""

from cokit.workloads.digits_ae import DigitsAEWorkload, DigitsAEWorkloadConfig, DigitsAutoencoder
from cokit.workloads.digits_cnn import DigitsCNN, DigitsCNNWorkload, DigitsCNNWorkloadConfig
from cokit.workloads.model import MODEL_PRESETS, CharTransformer, ModelConfig
from cokit.workloads.text import CharCorpus, CorpusConfig, TextWorkload, TextWorkloadConfig

__all__ = [
    "MODEL_PRESETS",
    "CharCorpus",
    "CharTransformer",
    "CorpusConfig",
    "DigitsAEWorkload",
    "DigitsAEWorkloadConfig",
    "DigitsAutoencoder",
    "DigitsCNN",
    "DigitsCNNWorkload",
    "DigitsCNNWorkloadConfig",
    "ModelConfig",
    "TextWorkload",
    "TextWorkloadConfig",
]
