"""A character-level corpus from text that ships with Python: its standard library's ``.py``
sources (``source="python"``, the default), English prose (``"prose"``: the language
reference's topics in ``pydoc_data`` and the stdlib's license and IDLE text files), or C
(``"c"``: the interpreter's C headers).

No download: the text is whatever ``sysconfig.get_paths()`` points at (for ``python``: tests,
``site-packages`` and caches excluded). Files are taken in a fixed pseudo-random order (by the
SHA-256 of their relative path, so the corpus mixes packages) until ``max_chars`` characters;
each file is cut to ``max_file_chars`` so no single file dominates; whole files go to the held-out split, chosen by ``split_seed``. The vocabulary is fixed: tab,
newline, printable ASCII and one "unknown" id for everything else.

Batches are deterministic from ``(seed, step, rank)``: every method in a comparison sees the same
data in the same order, and each rank samples only from its own contiguous shard of the
training text.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import os
import sysconfig
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from cokit.workloads.model import CharTransformer, ModelConfig

VOCAB = "\t\n" + "".join(chr(c) for c in range(32, 127))
UNKNOWN_ID = len(VOCAB)
VOCAB_SIZE = len(VOCAB) + 1
# tests, installed packages, caches, and generated data tables (not code a person wrote)
EXCLUDED_DIRS = frozenset(
    {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__", "pydoc_data", "encodings"}
)
#: corpus source -> what it is (CorpusConfig.source)
SOURCES = {
    "python": "python stdlib .py sources",
    "prose": "English prose: pydoc_data language-reference topics, stdlib LICENSE and idlelib .txt",
    "c": "C: the interpreter's C headers (sysconfig include dir)",
}
_BATCH_STREAM = 0x7E47  # keeps batch sampling apart from other uses of the same seed

_LUT = np.full(128, UNKNOWN_ID, dtype=np.uint8)
for _i, _ch in enumerate(VOCAB):
    _LUT[ord(_ch)] = _i


def encode(text: str) -> torch.Tensor:
    """Characters -> ids (uint8); characters outside the vocabulary become ``UNKNOWN_ID``."""
    codes = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
    ids = np.where(codes < 128, _LUT[codes & 127], UNKNOWN_ID).astype(np.uint8)
    return torch.from_numpy(ids)


def decode(ids: torch.Tensor | list[int]) -> str:
    """Ids -> text; the unknown id prints as U+FFFD."""
    return "".join(VOCAB[i] if i < len(VOCAB) else "\ufffd" for i in torch.as_tensor(ids).tolist())


@dataclass(frozen=True)
class CorpusConfig:
    """Which text, how much of it, and how it is split.

    ``root`` defaults to the running interpreter's standard library. ``split_seed`` picks the
    held-out files; it is separate from the training seed so that runs with different training
    seeds are evaluated on the same held-out text.
    """

    max_chars: int = 2_000_000
    max_file_chars: int = 50_000
    heldout_fraction: float = 0.1
    split_seed: int = 0
    root: str | None = None
    source: str = "python"

    def __post_init__(self) -> None:
        if self.source not in SOURCES:
            raise ValueError(f"source must be one of {', '.join(SOURCES)}, got {self.source!r}")
        if self.max_chars < 10_000:
            raise ValueError(f"max_chars must be >= 10000, got {self.max_chars}")
        if self.max_file_chars < 1000:
            raise ValueError(f"max_file_chars must be >= 1000, got {self.max_file_chars}")
        if not 0.0 < self.heldout_fraction < 0.5:
            raise ValueError(f"heldout_fraction must be in (0, 0.5), got {self.heldout_fraction}")


def stdlib_sources(root: str | Path | None = None) -> list[str]:
    """Relative POSIX paths of the ``.py`` files under ``root`` (default: the stdlib), sorted."""
    root = Path(root or sysconfig.get_paths()["stdlib"])
    found: list[str] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in EXCLUDED_DIRS and not d.startswith(".")]
        rel = Path(dirpath).relative_to(root)
        found.extend(
            (rel / f).as_posix()
            for f in filenames
            if f.endswith(".py") and not f.startswith("_sysconfigdata")
        )
    return sorted(found)


def _mix_key(relpath: str) -> str:
    return hashlib.sha256(relpath.encode()).hexdigest()


@dataclass
class CharCorpus:
    """Encoded train and held-out text (uint8 ids) and where it came from."""

    config: CorpusConfig
    root: str
    train: torch.Tensor
    heldout: torch.Tensor
    train_files: list[str] = field(repr=False)
    heldout_files: list[str] = field(repr=False)
    sha256: str = ""

    @classmethod
    def build(cls, config: CorpusConfig = CorpusConfig()) -> CharCorpus:
        """Read, encode and split the corpus (cached per config within a process)."""
        return _build_corpus(config)

    @classmethod
    def read(cls, config: CorpusConfig = CorpusConfig()) -> CharCorpus:
        """Read, encode and split the corpus from disk (no cache)."""
        return _read_corpus(config)

    @property
    def num_chars(self) -> int:
        """Characters in both splits."""
        return int(self.train.numel() + self.heldout.numel())

    def info(self) -> dict:
        """JSON-ready description: source, sizes, file counts, content hash."""
        return {
            "text": SOURCES[self.config.source],
            "root": self.root,
            "files": len(self.train_files) + len(self.heldout_files),
            "heldout_files": len(self.heldout_files),
            "chars": self.num_chars,
            "train_chars": int(self.train.numel()),
            "heldout_chars": int(self.heldout.numel()),
            "vocab_size": VOCAB_SIZE,
            "unknown_fraction": float((torch.cat([self.train, self.heldout]) == UNKNOWN_ID).float().mean()),
            "sha256": self.sha256,
            **{k: v for k, v in dataclasses.asdict(self.config).items() if k != "root"},
        }


@functools.lru_cache(maxsize=4)
def _build_corpus(config: CorpusConfig) -> CharCorpus:
    return _read_corpus(config)


def _documents(config: CorpusConfig) -> tuple[Path, list[tuple[str, Callable[[], str]]]]:
    """(root, [(name, read)]) of the source's documents, in the fixed mixing order."""
    paths = sysconfig.get_paths()
    if config.source == "prose":
        import pydoc_data.topics

        root = Path(config.root or paths["stdlib"])
        topics = pydoc_data.topics.topics
        docs: list[tuple[str, Callable[[], str]]] = [
            (f"pydoc_data/topics/{key}", functools.partial(topics.__getitem__, key)) for key in topics
        ]
        files = [
            "LICENSE.txt",
            *sorted(p.relative_to(root).as_posix() for p in (root / "idlelib").glob("*.txt")),
        ]
        docs += [(rel, functools.partial(_read, root / rel)) for rel in files if (root / rel).is_file()]
    elif config.source == "c":
        root = Path(config.root or paths["include"])
        headers = sorted(p.relative_to(root).as_posix() for p in root.rglob("*.h"))
        docs = [(rel, functools.partial(_read, root / rel)) for rel in headers]
    else:
        root = Path(config.root or paths["stdlib"])
        docs = [(rel, functools.partial(_read, root / rel)) for rel in stdlib_sources(root)]
    return root, sorted(docs, key=lambda d: _mix_key(d[0]))


def _read(path: Path) -> str:
    return path.read_text(encoding="utf-8", errors="replace")


def _read_corpus(config: CorpusConfig) -> CharCorpus:
    root, documents = _documents(config)
    texts: list[tuple[str, str]] = []
    total = 0
    for rel, read in documents:
        if total >= config.max_chars:
            break
        try:
            text = read()
        except OSError:
            continue
        if not text:
            continue
        if not text.endswith("\n"):
            text += "\n"
        text = text[: min(config.max_file_chars, config.max_chars - total)]
        texts.append((rel, text))
        total += len(text)
    if total < config.max_chars // 2 or len(texts) < 4:
        raise RuntimeError(
            f"only {total} characters of {config.source} text in {len(texts)} documents under {root} "
            f"(asked for {config.max_chars} characters in at least 4 documents); lower max_chars, "
            "or max_file_chars to cut the text into more documents"
        )

    order = torch.randperm(len(texts), generator=torch.Generator().manual_seed(config.split_seed))
    heldout_idx: set[int] = set()
    held = 0
    target = config.heldout_fraction * total
    for i in order.tolist():  # files in seeded order; skip those that would overshoot a lot
        if held >= target or len(heldout_idx) == len(texts) - 1:
            break
        if held + len(texts[i][1]) <= 1.25 * target:
            heldout_idx.add(i)
            held += len(texts[i][1])
    train_parts = [t for i, t in enumerate(texts) if i not in heldout_idx]
    held_parts = [t for i, t in enumerate(texts) if i in heldout_idx]
    train = encode("".join(t for _, t in train_parts))
    heldout = encode("".join(t for _, t in held_parts))
    digest = hashlib.sha256(train.numpy().tobytes() + b"\0" + heldout.numpy().tobytes()).hexdigest()
    return CharCorpus(
        config=config,
        root=str(root),
        train=train,
        heldout=heldout,
        train_files=[r for r, _ in train_parts],
        heldout_files=[r for r, _ in held_parts],
        sha256=digest,
    )


def batch_rng(seed: int, step: int, rank: int) -> np.random.Generator:
    """The random stream for one rank's batch at one step."""
    return np.random.default_rng([seed, step, rank, _BATCH_STREAM])


def _windows(data: torch.Tensor, starts: np.ndarray, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    idx = torch.from_numpy(starts.astype(np.int64))[:, None] + torch.arange(seq_len + 1)
    chunk = data[idx.to(data.device)].long()
    return chunk[:, :-1].contiguous(), chunk[:, 1:].contiguous()


@dataclass(frozen=True)
class TextWorkloadConfig:
    """A corpus, a model and the batch shape (``batch_size`` sequences per rank per step)."""

    corpus: CorpusConfig = CorpusConfig()
    model: ModelConfig = ModelConfig(vocab_size=VOCAB_SIZE)
    batch_size: int = 16
    eval_batches: int = 8

    def __post_init__(self) -> None:
        if self.batch_size < 1 or self.eval_batches < 1:
            raise ValueError("batch_size and eval_batches must be >= 1")
        if self.model.vocab_size != VOCAB_SIZE:
            raise ValueError(f"model.vocab_size must be {VOCAB_SIZE} for this corpus")

    def build(self, device: torch.device | str = "cpu") -> TextWorkload:
        """The workload on ``device`` (what each rank of a distributed run calls)."""
        return TextWorkload(self, device)


class TextWorkload:
    """Next-character prediction on the stdlib corpus with a :class:`CharTransformer`."""

    def __init__(
        self, config: TextWorkloadConfig = TextWorkloadConfig(), device: torch.device | str = "cpu"
    ) -> None:
        self.config = config
        self.device = torch.device(device)
        self.corpus = CharCorpus.build(config.corpus)
        self.train = self.corpus.train.to(self.device)  # batches are cut on the device (no per-step copy)
        self.seq_len = config.model.max_seq_len
        if self.corpus.heldout.numel() <= self.seq_len + 1:
            raise ValueError("held-out text is shorter than one sequence")

    def build_model(self, seed: int) -> CharTransformer:
        """A freshly initialised model (identical on every rank for the same seed)."""
        return CharTransformer(self.config.model, seed=seed).to(self.device)

    def check_world(self, world_size: int) -> None:
        """Raise ValueError when ``world_size`` ranks would leave a shard shorter than one sequence."""
        if self.corpus.train.numel() // world_size <= self.seq_len + 1:  # the shortest shard
            raise ValueError(f"world size {world_size} leaves shards shorter than one sequence")

    def shard(self, rank: int, world_size: int) -> torch.Tensor:
        """This rank's contiguous slice of the training text."""
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in [0, {world_size})")
        self.check_world(world_size)
        n = self.train.numel()
        return self.train[rank * n // world_size : (rank + 1) * n // world_size]

    def train_batch(
        self, seed: int, step: int, rank: int, world_size: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and next-character targets, ``(batch_size, seq_len)`` int64 each."""
        data = self.shard(rank, world_size)
        starts = batch_rng(seed, step, rank).integers(0, data.numel() - self.seq_len, self.config.batch_size)
        return _windows(data, starts, self.seq_len)

    def heldout_batches(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The fixed evaluation set: evenly spaced windows over the held-out text."""
        n = self.config.eval_batches * self.config.batch_size
        starts = np.linspace(0, self.corpus.heldout.numel() - self.seq_len - 1, n).round()
        x, y = _windows(self.corpus.heldout, starts, self.seq_len)
        b = self.config.batch_size
        return [(x[i : i + b].to(self.device), y[i : i + b].to(self.device)) for i in range(0, n, b)]

    @staticmethod
    def loss(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """Mean cross-entropy in nats per character."""
        x, y = batch
        logits = model(x)
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), y.flatten())

    def info(self) -> dict:
        """JSON-ready description of the workload."""
        return {
            "task": "next-character prediction",
            "batch_size_per_rank": self.config.batch_size,
            "seq_len": self.seq_len,
            "eval_batches": self.config.eval_batches,
            "uniform_loss": float(np.log(VOCAB_SIZE)),
            "corpus": self.corpus.info(),
            "model": dataclasses.asdict(self.config.model),
        }
