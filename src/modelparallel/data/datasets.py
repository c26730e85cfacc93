"""Real text that needs no download: the source code of Python's standard library."""

from __future__ import annotations

import sysconfig
from pathlib import Path

import torch
from torch.utils.data import Dataset


def python_source_bytes(max_bytes: int = 4_000_000) -> bytes:
    """The standard library's top-level ``.py`` files, concatenated in name order.

    Deterministic for one Python installation, so every rank reads the same text.
    """
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    chunks, total = [], 0
    for path in sorted(stdlib.glob("*.py")):
        data = path.read_bytes()
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    if not chunks:
        raise FileNotFoundError(f"no Python source files found in {stdlib}")
    return b"".join(chunks)[:max_bytes]


class ByteChunks(Dataset):
    """Non-overlapping windows of ``seq_len + 1`` bytes as (inputs, next-byte targets)."""

    vocab_size = 256

    def __init__(self, data: bytes, seq_len: int):
        self.tokens = torch.frombuffer(bytearray(data), dtype=torch.uint8).long()
        self.seq_len = seq_len
        if len(self.tokens) <= seq_len:
            raise ValueError(f"{len(self.tokens)} bytes are too few for seq_len={seq_len}")

    def __len__(self) -> int:
        return (len(self.tokens) - 1) // self.seq_len

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        window = self.tokens[i * self.seq_len: (i + 1) * self.seq_len + 1]
        return window[:-1], window[1:]


def train_val_split(data: bytes, val_fraction: float = 0.05) -> tuple[bytes, bytes]:
    """The first part for training, the last ``val_fraction`` held out."""
    cut = int(len(data) * (1 - val_fraction))
    return data[:cut], data[cut:]
