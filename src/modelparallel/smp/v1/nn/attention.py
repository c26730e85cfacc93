"""SMP v1's ``DistributedAttentionLayer`` and ``DistributedTransformerOutputLayer``: the
two halves of a transformer layer, as SMP's source computes them.

Under tensor parallelism (``plans.py``) attention is split by heads (query/key/value
column-parallel, ``dense`` row-parallel) and the output layer column-then-row
(``dense1``/``dense2``), Megatron's layout; layer norms stay whole.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from modelparallel.smp.v1.nn import _args
from modelparallel.smp.v1.nn.layers import (
    DistributedModule,
    activate,
    attention_scale,
    init_linear,
    layer_norm,
    residual,
    shared_input,
)
from modelparallel.smp.v2.nn.flash_attention import FlashSelfAttention

MASKED = -10000.0  # SMP's additive value for masked attention scores


class DistributedAttentionLayer(DistributedModule):
    """Self- (or cross-) attention: optional pre-layernorm, query/key/value, scaled
    dot-product attention (``softmax(q k^T / sqrt(attention_head_size) + mask)``, with
    a causal mask when ``causal_mask_size`` is set), ``dense``, dropout, the residual
    connection, and an optional post-layernorm.

    ``forward((hidden_states, attention_mask))`` or, with ``cross_attention=True``,
    ``forward((hidden_states, cross_states, attention_mask))``: ``hidden_states``
    ``[N, S, H]``; ``attention_mask`` is added to the scores (``[N, 1, 1, S]``, 0 where
    attended, a large negative value where masked; ``None`` for none). Returns the layer's
    output ``[N, S, H]``. Keys and values of cross-attention come from ``cross_states``.
    """

    def __init__(self, num_attention_heads: int = 32, attention_head_size: int = 32,
                 hidden_size: int = 1024, attention_dropout_prob: float = 0.1,
                 hidden_dropout_prob: float = 0.1, layernorm_epsilon: float = 1e-5,
                 initializer_range: float = 0.02, use_normal_initialization: bool = False,
                 cross_attention: bool = False, causal_mask_size: int | None = None,
                 pre_layernorm: bool = False, post_layernorm: bool = True, **kwargs: Any):
        super().__init__()
        ex = _args.extra(kwargs, type(self).__name__)
        self.num_attention_heads = num_attention_heads
        self.attention_head_size = attention_head_size
        self.hidden_size = hidden_size
        self.cross_attention = cross_attention
        self.causal_mask_size = causal_mask_size
        self.fp32_residual_addition = ex.fp32_residual_addition
        self.attention_in_fp32 = ex.attention_in_fp32
        width = num_attention_heads * attention_head_size
        self.query = nn.Linear(hidden_size, width)
        self.key = nn.Linear(hidden_size, width)
        self.value = nn.Linear(hidden_size, width)
        self.dense = nn.Linear(width, hidden_size)
        for layer in (self.query, self.key, self.value, self.dense):
            init_linear(layer, use_normal_initialization, initializer_range)
        # softmax, attention dropout and the product with values (SDPA); a module, so that
        # tensor parallelism can give it a per-rank random stream (its heads are split)
        self.core = FlashSelfAttention(attention_dropout_prob, scale=attention_scale(
            attention_head_size, ex.scale_attention_scores, ex.scale_attn_by_layer_idx,
            ex.layer_idx))
        self.dropout2 = nn.Dropout(hidden_dropout_prob)
        self.pre_layernorm = layer_norm(pre_layernorm, hidden_size, layernorm_epsilon)
        self.layernorm = layer_norm(post_layernorm, hidden_size, layernorm_epsilon)

    def _mask(self, attention_mask: torch.Tensor | None, q_len: int, k_len: int,
              like: torch.Tensor) -> torch.Tensor | None:
        if self.causal_mask_size is None or self.cross_attention:
            return attention_mask
        if k_len > self.causal_mask_size:
            raise ValueError(f"{type(self).__name__}: sequence length {k_len} exceeds "
                             f"causal_mask_size={self.causal_mask_size}")
        keep = torch.ones(q_len, k_len, dtype=torch.bool, device=like.device).tril(k_len - q_len)
        causal = torch.zeros(q_len, k_len, dtype=like.dtype, device=like.device)
        causal = causal.masked_fill(~keep, MASKED)
        return causal if attention_mask is None else attention_mask.to(like.dtype) + causal

    def forward(self, inp: tuple[torch.Tensor, ...]) -> torch.Tensor:
        if self.cross_attention:
            hidden_states, cross_states, attention_mask = inp
        else:
            hidden_states, attention_mask = inp
        x = hidden_states if self.pre_layernorm is None else self.pre_layernorm(hidden_states)
        x = shared_input(x, self.query.weight)
        source = shared_input(cross_states, self.key.weight) if self.cross_attention else x
        q, k, v = self.query(x), self.key(source), self.value(source)
        b, s = q.shape[:2]

        def heads(t: torch.Tensor) -> torch.Tensor:  # [b, s, h*d] -> [b, s, h, d]; h local
            return t.view(t.shape[0], t.shape[1], -1, self.attention_head_size)

        mask = self._mask(attention_mask, s, k.shape[1], q)
        context = self.core((heads(q), heads(k), heads(v)), attn_mask=mask, layout="b s h d",
                            cast_dtype=torch.float32 if self.attention_in_fp32 else None)
        out = self.dropout2(self.dense(context.reshape(b, s, -1).to(v.dtype)))
        out = residual(hidden_states, out, self.fp32_residual_addition)
        return out if self.layernorm is None else self.layernorm(out)


class DistributedTransformerOutputLayer(DistributedModule):
    """The MLP half of a transformer layer: optional pre-layernorm, ``dense1`` (hidden ->
    intermediate), GeLU or ReLU, ``dense2`` (back to hidden), dropout, the residual
    connection, optional post-layernorm. ``forward(hidden_states)`` -> ``[N, S, H]``.

    GeLU is the exact one (``F.gelu``), as in SMP; ``SMP_USE_HF_GELU=1`` in the environment
    selects the tanh approximation (Hugging Face's ``gelu_new``), as in SMP.
    """

    def __init__(self, hidden_size: int = 1024, intermediate_size: int = 4096,
                 hidden_dropout_prob: float = 0.1, activation: str = "gelu",
                 layernorm_epsilon: float = 1e-5, initializer_range: float = 0.02,
                 use_normal_initialization: bool = False, pre_layernorm: bool = False,
                 post_layernorm: bool = True, fp32_residual_addition: bool = False,
                 **kwargs: Any):
        super().__init__()
        ex = _args.extra(kwargs, type(self).__name__)
        _args.check_activation(activation, type(self).__name__)
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.activation = activation
        self.hf_gelu = ex.hf_gelu
        self.fp32_residual_addition = fp32_residual_addition
        self.dense1 = nn.Linear(hidden_size, intermediate_size)
        self.dense2 = nn.Linear(intermediate_size, hidden_size)
        for layer in (self.dense1, self.dense2):
            init_linear(layer, use_normal_initialization, initializer_range)
        self.dropout = nn.Dropout(hidden_dropout_prob)
        self.pre_layernorm = layer_norm(pre_layernorm, hidden_size, layernorm_epsilon)
        self.layernorm = layer_norm(post_layernorm, hidden_size, layernorm_epsilon)

    def forward(self, inp: torch.Tensor) -> torch.Tensor:
        x = inp if self.pre_layernorm is None else self.pre_layernorm(inp)
        out = self.dropout(self.dense2(activate(self.dense1(x), self.activation, self.hf_gelu)))
        out = residual(inp, out, self.fp32_residual_addition)
        return out if self.layernorm is None else self.layernorm(out)


__all__ = ["DistributedAttentionLayer", "DistributedTransformerOutputLayer"]
