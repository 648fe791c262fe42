"""The demo's data: a character-level corpus shipped with the package (data/corpus.txt, public
domain, see data/README.md) and a deterministic batch sampler.

Every step draws one global batch of `batch` windows from the corpus (positions from a
generator seeded with (seed, step)); worker r of N trains on rows r, r+N, ... of it, so the N
workers together see exactly the global batch, and a single process on the whole batch is the
reference that data-parallel training must match.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

import torch

CORPUS = "corpus.txt"


class CharCorpus:
    def __init__(self, text: str):
        if len(text) < 2:
            raise ValueError("the corpus needs at least two characters")
        self.chars = sorted(set(text))
        self.index = {c: i for i, c in enumerate(self.chars)}
        self.tokens = torch.tensor([self.index[c] for c in text], dtype=torch.long)

    @classmethod
    def load(cls, path: str | Path | None = None) -> CharCorpus:
        """The packaged corpus, or a UTF-8 text file."""
        if path is None:
            text = resources.files("luwu.demo").joinpath("data").joinpath(CORPUS).read_text(encoding="utf-8")
        else:
            text = Path(path).read_text(encoding="utf-8")
        return cls(text)

    @property
    def vocab(self) -> int:
        return len(self.chars)

    def decode(self, ids) -> str:
        return "".join(self.chars[int(i)] for i in ids)

    def batch(self, step: int, batch: int, context: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The global batch of `step`: inputs and next-character targets, each (batch, context)."""
        if len(self.tokens) <= context + 1:
            raise ValueError(f"the corpus ({len(self.tokens)} characters) is shorter than the context {context} + 1")
        g = torch.Generator().manual_seed(seed * 1_000_003 + step)
        starts = torch.randint(0, len(self.tokens) - context - 1, (batch,), generator=g)
        rows = torch.stack([self.tokens[s: s + context + 1] for s in starts.tolist()])
        return rows[:, :-1], rows[:, 1:]


def shard(x: torch.Tensor, y: torch.Tensor, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Worker `rank`'s rows of the global batch."""
    if x.shape[0] % world:
        raise ValueError(f"the global batch ({x.shape[0]} rows) must divide among {world} workers")
    return x[rank::world], y[rank::world]
