"""``smp.nn`` (SMP v1 ``smdistributed.modelparallel.torch.nn``) and ``tsm.nn`` (SMP v2
``torch.sagemaker.nn``): distributed modules built from plain PyTorch.

SMP v1's classes are here (``DistributedTransformerLMHead``, ``DistributedTransformer``,
``DistributedTransformerLayer``, ``DistributedAttentionLayer``,
``DistributedTransformerOutputLayer``, ``DistributedLinear``, ``DistributedEmbedding``,
``DistributedLayerNorm``, ``FusedLayerNorm``, ``FlashAttentionLayer``,
``DistributedModule``); SMP v2's
FlashAttention modules in ``attn``; the Hugging Face translators in ``huggingface``; SMP
v2's ``tensor_parallel.transformer`` classes in ``tensor_parallel_transformer``.

Each module is an ordinary single-device module with a tensor-parallel plan
(``plans.py``, registered on import): with ``tensor_parallel_degree`` 1 it is what it
is; with more, ``smp.DistributedModel`` (or ``tsm.transform``) splits it over the
tensor-parallel ranks in Megatron's layout, and training matches one process
(docs/smp-nn.md).
"""

# plans registers the modules' TP plans; the submodules are attributes, as in SMP
# (``smp.nn.huggingface.gpt2.translate_state_dict_to_hf_gpt2``, ``tsm.nn.attn``)
from modelparallel.smp.nn import attn, huggingface, plans, tensor_parallel_transformer  # noqa: F401
from modelparallel.smp.nn.attention import (
    DistributedAttentionLayer,
    DistributedTransformerOutputLayer,
)
from modelparallel.smp.nn.attn import FlashAttentionLayer
from modelparallel.smp.nn.layers import (
    DistributedEmbedding,
    DistributedLayerNorm,
    DistributedLinear,
    DistributedModule,
    FusedLayerNorm,
)
from modelparallel.smp.nn.transformer import (
    DistributedTransformer,
    DistributedTransformerLayer,
    DistributedTransformerLMHead,
)

__all__ = ["DistributedAttentionLayer", "DistributedEmbedding", "DistributedLayerNorm",
           "DistributedLinear", "DistributedModule", "DistributedTransformer",
           "DistributedTransformerLMHead", "DistributedTransformerLayer",
           "DistributedTransformerOutputLayer", "FlashAttentionLayer", "FusedLayerNorm"]
