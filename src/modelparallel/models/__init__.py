"""Reference single-device models used by the examples, tests and benchmarks, and the
tensor-parallel plans of models (``plans``: these and Hugging Face families)."""

from modelparallel.models import plans  # noqa: F401  (registers the built-in plans)
from modelparallel.models.gpt import GPT, GPTConfig
from modelparallel.models.vit import ViT, ViTConfig

__all__ = ["GPT", "GPTConfig", "ViT", "ViTConfig"]
