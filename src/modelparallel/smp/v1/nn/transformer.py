"""SMP v1's ``DistributedTransformerLayer``, ``DistributedTransformer`` and
``DistributedTransformerLMHead``, with their documented arguments and tuple conventions.

Parameter names follow SMP's (``transformer.seq_layers.<i>.attention.query.weight``,
``word_embedding.weight``, ...), so SMP's state-dict translators
(``huggingface/gpt2.py``) and checkpoints written for SMP's layout apply unchanged.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from modelparallel.smp.v1.nn import _args
from modelparallel.smp.v1.nn.attention import (
    MASKED,
    DistributedAttentionLayer,
    DistributedTransformerOutputLayer,
)
from modelparallel.smp.v1.nn.layers import DistributedModule


class DistributedTransformerLayer(DistributedModule):
    """One transformer layer: a ``DistributedAttentionLayer`` (then a cross-attention one
    with ``add_cross_attention``) and a ``DistributedTransformerOutputLayer``.

    ``forward((hidden_states, attention_mask))`` -> ``(hidden_states, attention_mask)``;
    with ``add_cross_attention``: ``forward((hidden_states, cross_states, attention_mask,
    cross_mask))`` -> the same four. ``attention_mask`` ``[N, 1, 1, S]`` is added to the
    attention scores. With both ``pre_layernorm`` and ``post_layernorm`` the attention
    has only its pre-layernorm and the output layer both (SMP's arrangement).
    ``activation`` is ``"gelu"`` or ``"relu"``. Sizes are global: under tensor
    parallelism the heads and the intermediate width are split over the ranks.
    """

    def __init__(self, num_attention_heads: int = 32, attention_head_size: int = 32,
                 hidden_size: int = 1024, intermediate_size: int = 4096,
                 attention_dropout_prob: float = 0.1, hidden_dropout_prob: float = 0.1,
                 activation: str = "gelu", layernorm_epsilon: float = 1e-5,
                 initializer_range: float = 0.02, use_normal_initialization: bool = False,
                 causal_mask_size: int | None = None, add_cross_attention: bool = False,
                 pre_layernorm: bool = False, post_layernorm: bool = True, **kwargs: Any):
        super().__init__()
        name = type(self).__name__
        ex = _args.extra(kwargs, name)
        _args.check_layernorms(pre_layernorm, post_layernorm, name)
        _args.check_activation(activation, name)
        self.add_cross_attention = add_cross_attention
        common: dict[str, Any] = dict(num_attention_heads=num_attention_heads,
                      attention_head_size=attention_head_size, hidden_size=hidden_size,
                      attention_dropout_prob=attention_dropout_prob,
                      hidden_dropout_prob=hidden_dropout_prob, layernorm_epsilon=layernorm_epsilon,
                      initializer_range=initializer_range,
                      use_normal_initialization=use_normal_initialization,
                      causal_mask_size=causal_mask_size, pre_layernorm=pre_layernorm,
                      post_layernorm=post_layernorm and not pre_layernorm)
        passed = ex.passed_on()
        attention_only = {k: passed[k] for k in ("fp32_residual_addition", "attention_in_fp32",
                                                 "scale_attention_scores",
                                                 "scale_attn_by_layer_idx", "layer_idx")}
        self.attention = DistributedAttentionLayer(**common, **attention_only)
        if add_cross_attention:
            self.cross_attention = DistributedAttentionLayer(**common, cross_attention=True,
                                                             **attention_only)
        self.output = DistributedTransformerOutputLayer(
            hidden_size, intermediate_size, hidden_dropout_prob, activation, layernorm_epsilon,
            initializer_range, use_normal_initialization, pre_layernorm=pre_layernorm,
            post_layernorm=post_layernorm, fp32_residual_addition=ex.fp32_residual_addition)

    def forward(self, inp: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        if self.add_cross_attention:
            hidden_states, cross_states, attention_mask, cross_mask = inp
        else:
            hidden_states, attention_mask = inp
        out = self.attention((hidden_states, attention_mask))
        if self.add_cross_attention:
            out = self.cross_attention((out, cross_states, cross_mask))
        out = self.output(out)
        if self.add_cross_attention:
            return out, cross_states, attention_mask, cross_mask
        return out, attention_mask


class DistributedTransformer(DistributedModule):
    """``num_layers`` ``DistributedTransformerLayer``s in an ``nn.Sequential``
    (``seq_layers``); the other arguments and ``forward`` as for the layer. With both
    ``pre_layernorm`` and ``post_layernorm``, the post-layernorm is applied once, at
    the output of the last layer (GPT-2's final layer norm)."""

    def __init__(self, num_layers: int = 12, num_attention_heads: int = 32,
                 attention_head_size: int = 32, hidden_size: int = 1024,
                 intermediate_size: int = 4096, attention_dropout_prob: float = 0.1,
                 hidden_dropout_prob: float = 0.1, activation: str = "gelu",
                 layernorm_epsilon: float = 1e-5, initializer_range: float = 0.02,
                 use_normal_initialization: bool = False, causal_mask_size: int | None = None,
                 add_cross_attention: bool = False, pre_layernorm: bool = False,
                 post_layernorm: bool = True, **kwargs: Any):
        super().__init__()
        name = type(self).__name__
        ex = _args.extra(kwargs, name)
        _args.check_layernorms(pre_layernorm, post_layernorm, name)
        self.num_layers = num_layers
        passed = {k: v for k, v in ex.passed_on().items() if k != "embedding_dropout_prob"}
        layers = []
        for index in range(num_layers):
            passed["layer_idx"] = index
            last = index == num_layers - 1
            layers.append(DistributedTransformerLayer(
                num_attention_heads, attention_head_size, hidden_size, intermediate_size,
                attention_dropout_prob, hidden_dropout_prob, activation, layernorm_epsilon,
                initializer_range, use_normal_initialization, causal_mask_size,
                add_cross_attention, pre_layernorm,
                post_layernorm and (last or not pre_layernorm), **passed))
        self.seq_layers = nn.Sequential(*layers)

    def forward(self, inp: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        return self.seq_layers(inp)


class DistributedTransformerLMHead(DistributedModule):
    """Word + position (+ token-type) embeddings, dropout, a ``DistributedTransformer``
    and, with ``add_lm_head``, an LM head (no bias) tied to the word embedding.

    ``forward((input_ids, attention_mask, token_type_ids, position_ids, labels))``, with
    ``add_cross_attention`` ``forward((input_ids, attention_mask, token_type_ids,
    position_ids, cross_states, cross_mask, labels))``. ``input_ids`` ``[N, S]``;
    ``attention_mask`` ``[N, S]`` of 0/1 with **1 for a position that is attended and 0
    for a masked one** (what SMP's source does, Hugging Face's convention; SMP's
    documentation says the opposite), or ``None``; ``token_type_ids`` go through their own
    embedding when ``num_token_types`` > 0, else through the word embedding (GPT-2);
    ``position_ids`` default to ``0..S-1``. Returns the logits ``[N, S, vocab_size]``,
    or ``(loss, logits)`` when ``labels`` are given (next-token cross-entropy: logits at
    ``t`` against labels at ``t + 1``, ``-100`` ignored). Without an LM head it returns the
    transformer's hidden states.

    Under tensor parallelism the vocabulary is split (embedding and head alike), as are
    the heads and MLP widths of the layers.
    """

    def __init__(self, num_layers: int = 12, num_attention_heads: int = 32,
                 attention_head_size: int = 32, hidden_size: int = 1024,
                 intermediate_size: int = 4096, vocab_size: int = 30522,
                 num_positions: int = 1024, attention_dropout_prob: float = 0.1,
                 hidden_dropout_prob: float = 0.1, activation: str = "gelu",
                 layernorm_epsilon: float = 1e-5, num_token_types: int = 0,
                 causal_mask_size: int | None = None, add_cross_attention: bool = False,
                 add_lm_head: bool = True, initializer_range: float = 0.02,
                 use_normal_initialization: bool = False, pre_layernorm: bool = False,
                 post_layernorm: bool = True, **kwargs: Any):
        super().__init__()
        name = type(self).__name__
        ex = _args.extra(kwargs, name)
        _args.check_layernorms(pre_layernorm, post_layernorm, name)
        if causal_mask_size is not None and num_positions > causal_mask_size:
            raise ValueError(f"{name}: causal_mask_size ({causal_mask_size}) must be at least "
                             f"num_positions ({num_positions})")
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.num_token_types = num_token_types
        self.add_cross_attention = add_cross_attention
        self.add_lm_head = add_lm_head
        self.word_embedding = nn.Embedding(vocab_size, hidden_size)
        self.position_embedding = nn.Embedding(num_positions, hidden_size)
        embeddings = [self.word_embedding, self.position_embedding]
        if num_token_types > 0:
            self.token_type_embedding = nn.Embedding(num_token_types, hidden_size)
            embeddings.append(self.token_type_embedding)
        with torch.no_grad():  # SMP initialises embeddings N(0, initializer_range) always
            for embedding in embeddings:
                nn.init.normal_(embedding.weight, std=initializer_range)
        embedding_dropout = ex.embedding_dropout_prob
        self.dropout = nn.Dropout(hidden_dropout_prob if embedding_dropout is None
                                  else embedding_dropout)
        passed = {k: v for k, v in ex.passed_on().items()
                  if k not in ("embedding_dropout_prob", "layer_idx")}
        self.transformer = DistributedTransformer(
            num_layers, num_attention_heads, attention_head_size, hidden_size,
            intermediate_size, attention_dropout_prob, hidden_dropout_prob, activation,
            layernorm_epsilon, initializer_range, use_normal_initialization, causal_mask_size,
            add_cross_attention, pre_layernorm, post_layernorm, **passed)
        self.ce_loss = nn.CrossEntropyLoss()
        if add_lm_head:
            self.lm_head = nn.Linear(hidden_size, vocab_size, bias=False)
            self.lm_head.weight = self.word_embedding.weight

    def forward(self, inputs: tuple[Any, ...]) -> Any:
        if self.add_cross_attention:
            (input_ids, attention_mask, token_type_ids, position_ids, cross_states, cross_mask,
             labels) = inputs
        else:
            input_ids, attention_mask, token_type_ids, position_ids, labels = inputs
        n, s = input_ids.shape
        if position_ids is None:
            position_ids = torch.arange(s, device=input_ids.device).unsqueeze(0)
        hidden = self.word_embedding(input_ids) + self.position_embedding(position_ids)
        if token_type_ids is not None:
            types = self.token_type_embedding if self.num_token_types > 0 else self.word_embedding
            hidden = hidden + types(token_type_ids)
        hidden = self.dropout(hidden)
        mask = _extended(attention_mask, n, hidden.dtype)
        if self.add_cross_attention:
            if cross_mask is None:
                cross_mask = torch.ones(cross_states.shape[:2], device=cross_states.device)
            tx: tuple[Any, ...] = (hidden, cross_states, mask,
                                   _extended(cross_mask, n, hidden.dtype))
        else:
            tx = (hidden, mask)
        hidden = self.transformer(tx)[0]
        if not self.add_lm_head:
            return hidden
        logits = self.lm_head(hidden)
        if labels is None:
            return logits
        shifted = logits[..., :-1, :].contiguous()
        loss = self.ce_loss(shifted.view(-1, shifted.size(-1)), labels[..., 1:].reshape(-1))
        return loss, logits


def _extended(mask: torch.Tensor | None, n: int, dtype: torch.dtype) -> torch.Tensor | None:
    """A 0/1 ``[N, S]`` mask (1 = attended) as the additive ``[N, 1, 1, S]`` the layers take."""
    if mask is None:
        return None
    return (1.0 - mask.reshape(n, -1)[:, None, None, :].to(dtype)) * MASKED


__all__ = ["DistributedTransformer", "DistributedTransformerLMHead",
           "DistributedTransformerLayer"]
