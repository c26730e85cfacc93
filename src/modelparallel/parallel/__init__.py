"""Appliers that turn a single-device model into a parallel one (see DESIGN.md)."""

from modelparallel.parallel.blocks import find_blocks
from modelparallel.parallel.replicate import replicate
from modelparallel.parallel.sharding import shard

__all__ = ["find_blocks", "replicate", "shard"]
