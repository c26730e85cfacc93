"""Reference single-device models used by the examples, tests and benchmarks."""

from modelparallel.models.gpt import GPT, GPTConfig

__all__ = ["GPT", "GPTConfig"]
