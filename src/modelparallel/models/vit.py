"""A small Vision Transformer, written the plain single-device way."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from modelparallel.models.gpt import Block, GPTConfig, init_weights


@dataclass
class ViTConfig:
    image_size: int = 32
    patch_size: int = 8
    channels: int = 3
    num_classes: int = 10
    d_model: int = 64
    n_layers: int = 4
    n_heads: int = 4
    d_ff: int | None = None  # default 4 * d_model
    dropout: float = 0.0

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2


class ViT(nn.Module):
    """Patch embedding + class token, ``n_layers`` bidirectional blocks, norm, class head."""

    def __init__(self, cfg: ViTConfig):
        super().__init__()
        if cfg.image_size % cfg.patch_size:
            raise ValueError(f"image_size={cfg.image_size} is not divisible by "
                             f"patch_size={cfg.patch_size}")
        self.cfg = cfg
        block_cfg = GPTConfig(d_model=cfg.d_model, n_heads=cfg.n_heads, d_ff=cfg.d_ff,
                              dropout=cfg.dropout)
        self.patch_emb = nn.Conv2d(cfg.channels, cfg.d_model, cfg.patch_size, cfg.patch_size)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, cfg.d_model))
        self.pos_emb = nn.Parameter(torch.zeros(1, cfg.num_patches + 1, cfg.d_model))
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(block_cfg, causal=False) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.num_classes)
        self.apply(init_weights)
        nn.init.normal_(self.pos_emb, std=0.02)
        nn.init.normal_(self.cls_token, std=0.02)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """Class logits of shape (batch, num_classes) for images (batch, C, H, W)."""
        x = self.patch_emb(images).flatten(2).transpose(1, 2)  # (b, patches, d)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1)
        x = self.drop(x + self.pos_emb)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x)[:, 0])
