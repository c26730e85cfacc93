"""Tensor-parallel plans of the ``smp.nn`` modules, registered with the core's plan
registry when ``smp.nn`` is imported (the modules own their plans, as models do in
``models/plans.py``).

Megatron's layout: attention split by heads (query/key/value column-parallel, ``dense``
row-parallel), the output layer column-then-row, the LM head's word embedding and head
by vocabulary (tied, both ``Shard(0)``). ``DistributedLinear`` is row-parallel (SMP
splits its input features), ``DistributedEmbedding`` split along ``embedding_dim``
(as SMP does). Layer norms, position and token-type embeddings stay whole.
"""

from __future__ import annotations

from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

from modelparallel.parallel.tensor.layouts import lm_head, vocab_embedding
from modelparallel.parallel.tensor.plans import REPLICATED, SHARDED, TPOptions, TPPlan, builtin
from modelparallel.smp.v1.nn.attention import (
    DistributedAttentionLayer,
    DistributedTransformerOutputLayer,
)
from modelparallel.smp.v1.nn.layers import DistributedEmbedding, DistributedLinear
from modelparallel.smp.v1.nn.transformer import DistributedTransformerLMHead
from modelparallel.smp.v2.nn.tensor_parallel_transformer import TransformerLMHead


@builtin(DistributedAttentionLayer)
def _attention(layer: DistributedAttentionLayer, o: TPOptions) -> TPPlan:
    return TPPlan(
        styles={"query": ColwiseParallel(), "key": ColwiseParallel(),
                "value": ColwiseParallel(), "dense": RowwiseParallel()},
        sizes={"attention heads": layer.num_attention_heads},
        # each rank's heads draw their own attention dropout; the output's is the same on all
        rng={"core": SHARDED, "dropout2": REPLICATED})


@builtin(DistributedTransformerOutputLayer)
def _output(layer: DistributedTransformerOutputLayer, o: TPOptions) -> TPPlan:
    return TPPlan(styles={"dense1": ColwiseParallel(), "dense2": RowwiseParallel()},
                  sizes={"intermediate size": layer.intermediate_size})


@builtin(DistributedTransformerLMHead, TransformerLMHead)
def _lm_head(model: DistributedTransformerLMHead, o: TPOptions) -> TPPlan:
    styles: dict[str, ParallelStyle] = {"word_embedding": vocab_embedding(o)}
    if model.add_lm_head:
        styles["lm_head"] = lm_head(o)
    return TPPlan(styles=styles, sizes={"vocabulary": model.vocab_size})


@builtin(DistributedLinear)
def _linear(layer: DistributedLinear, o: TPOptions) -> TPPlan:
    return TPPlan(styles={"": RowwiseParallel(input_layouts=Replicate())},
                  sizes={"input features": layer.in_features})


@builtin(DistributedEmbedding)
def _embedding(layer: DistributedEmbedding, o: TPOptions) -> TPPlan:
    return TPPlan(styles={"": ColwiseParallel(input_layouts=Replicate(),
                                              output_layouts=Replicate())},
                  sizes={"embedding dim": layer.embedding_dim})
