"""``smp.nn`` (SMP v1 ``smdistributed.modelparallel.torch.nn``) and ``tsm.nn`` (SMP v2
``torch.sagemaker.nn``): distributed modules built from plain PyTorch.

Both APIs' modules are reached here, as the two libraries named them; they live by API:
SMP v1's classes in ``smp/v1/nn/`` (``DistributedTransformerLMHead``,
``DistributedTransformer``, ``DistributedTransformerLayer``,
``DistributedAttentionLayer``, ``DistributedTransformerOutputLayer``,
``DistributedLinear``, ``DistributedEmbedding``, ``DistributedLayerNorm``,
``FusedLayerNorm``, ``DistributedModule``; the Hugging Face translators in
``huggingface``), SMP v2's in ``smp/v2/nn/`` (the FlashAttention modules, ``attn`` here,
and ``FlashAttentionLayer``, which SMP v1 also exported; the
``tensor_parallel.transformer`` classes in ``tensor_parallel_transformer``).

Each module is an ordinary single-device module with a tensor-parallel plan
(``plans.py``, registered on import): with ``tensor_parallel_degree`` 1 it is what it
is; with more, ``smp.DistributedModel`` (or ``tsm.transform``) splits it over the
tensor-parallel ranks in Megatron's layout, and training matches one process
(docs/smp-nn.md).
"""

# plans registers the modules' TP plans; the submodules are attributes, as in SMP
# (``smp.nn.huggingface.gpt2.translate_state_dict_to_hf_gpt2``, ``tsm.nn.attn``)
from modelparallel.smp.nn import plans  # noqa: F401
from modelparallel.smp.v1.nn import huggingface  # noqa: F401
from modelparallel.smp.v1.nn.attention import (
    DistributedAttentionLayer,
    DistributedTransformerOutputLayer,
)
from modelparallel.smp.v1.nn.layers import (
    DistributedEmbedding,
    DistributedLayerNorm,
    DistributedLinear,
    DistributedModule,
    FusedLayerNorm,
)
from modelparallel.smp.v1.nn.transformer import (
    DistributedTransformer,
    DistributedTransformerLayer,
    DistributedTransformerLMHead,
)
from modelparallel.smp.v2.nn import flash_attention as attn  # noqa: F401
from modelparallel.smp.v2.nn import tensor_parallel_transformer  # noqa: F401
from modelparallel.smp.v2.nn.flash_attention import FlashAttentionLayer

__all__ = ["DistributedAttentionLayer", "DistributedEmbedding", "DistributedLayerNorm",
           "DistributedLinear", "DistributedModule", "DistributedTransformer",
           "DistributedTransformerLMHead", "DistributedTransformerLayer",
           "DistributedTransformerOutputLayer", "FlashAttentionLayer", "FusedLayerNorm"]
