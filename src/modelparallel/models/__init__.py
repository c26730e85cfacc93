"""Reference single-device models used by the examples, tests and benchmarks."""

from modelparallel.models.gpt import GPT, GPTConfig
from modelparallel.models.vit import ViT, ViTConfig

__all__ = ["GPT", "GPTConfig", "ViT", "ViTConfig"]
