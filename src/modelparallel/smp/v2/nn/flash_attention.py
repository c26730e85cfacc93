"""SMP v2's ``torch.sagemaker.nn.attn``: FlashAttention modules, on torch's
``scaled_dot_product_attention`` (SDPA picks a flash or memory-efficient kernel where
the device has one, and a math kernel on CPU).

Both modules take their inputs in either layout, ``"b h s d"`` or ``"b s h d"``, and
return the output in the layout they were given (``[b, h, s, d]`` for the default
``"b h s d"`` of :class:`FlashSelfAttention`, which is what GPT-NeoX's ``_attn``
returns; ``[b, s, h, d]`` for the default ``"b s h d"`` of
:class:`FlashGroupedQueryAttention`, which a Llama attention reshapes to
``[b, s, h * d]``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from modelparallel.notices import notice

LAYOUTS = ("b h s d", "b s h d")
Packed = torch.Tensor | Sequence[torch.Tensor]


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
              mask: torch.Tensor | None = None, causal: bool = False,
              scale: float | None = None, dropout: float = 0.0) -> torch.Tensor:
    """``softmax(q k^T * scale + mask) v`` on ``[b, h, s, d]`` tensors, with SDPA.

    ``mask`` is additive (float, broadcastable to ``[b, h, s_q, s_k]``) or boolean
    (``True`` = attend, SDPA's convention). ``causal`` masks key ``j`` for query ``i``
    when ``j > i + s_k - s_q`` (aligned at the bottom right, as FlashAttention 2 does;
    the usual lower triangle when ``s_q == s_k``). Key/value heads may be fewer than
    query heads (grouped-query attention): query head ``i`` reads key/value head
    ``i // (h_q / h_kv)``.
    """
    hq, hk = q.shape[1], k.shape[1]
    if hq % hk:
        raise ValueError(f"{hq} query heads are not divisible by {hk} key/value heads")
    sq, sk = q.shape[2], k.shape[2]
    if causal and (mask is not None or sq != sk):
        keep = torch.ones(sq, sk, dtype=torch.bool, device=q.device).tril(sk - sq)
        if mask is None:
            mask = keep
        elif mask.dtype == torch.bool:
            mask = mask & keep
        else:  # added, not filled: the mask may broadcast over the query positions
            mask = mask + torch.zeros(sq, sk, dtype=mask.dtype, device=q.device).masked_fill(
                ~keep, float("-inf"))
        causal = False
    if mask is not None and mask.dtype != torch.bool:
        mask = mask.to(q.dtype)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout,
                                          is_causal=causal, scale=scale,
                                          enable_gqa=hq != hk)


def _check_layout(layout: str) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, not {layout!r}")


def _unpack(packed: Packed, parts: int, layout: str, name: str) -> list[torch.Tensor]:
    """Split ``parts`` tensors out of a tuple, a 4-D tensor with ``parts`` x heads on the
    head dimension (the chunks one after the other), or a 5-D tensor with a dimension of
    size ``parts`` before the heads (``b s 3 h d`` / ``b 3 h s d``, FlashAttention's
    packed layout)."""
    if not isinstance(packed, torch.Tensor):
        tensors = list(packed)
        if len(tensors) != parts:
            raise ValueError(f"{name} must hold {parts} tensors, got {len(tensors)}")
        return tensors
    heads_dim = 1 if layout == "b h s d" else 2
    if packed.ndim == 5 and packed.shape[heads_dim] == parts:
        return list(packed.unbind(heads_dim))
    if packed.ndim == 4 and packed.shape[heads_dim] % parts == 0:
        return list(packed.chunk(parts, dim=heads_dim))
    raise ValueError(f"{name} of shape {tuple(packed.shape)} is neither {parts} tensors nor "
                     f"packed in layout {layout!r} ({parts} x heads on dim {heads_dim}, or "
                     f"a 5-D tensor with {parts} on dim {heads_dim})")


def _to_bhsd(tensors: list[torch.Tensor], layout: str,
             cast_dtype: torch.dtype | None) -> list[torch.Tensor]:
    out = []
    for t in tensors:
        if t.ndim != 4:
            raise ValueError(f"attention inputs must be 4-D in layout {layout!r}, got shape "
                             f"{tuple(t.shape)}")
        if cast_dtype is not None:
            t = t.to(cast_dtype)
        out.append(t if layout == "b h s d" else t.transpose(1, 2))
    return out


class FlashSelfAttention(nn.Module):
    """Scaled dot-product self-attention (SMP v2 ``torch.sagemaker.nn.attn``).

    ``scale`` defaults to ``1 / sqrt(head_size)``. ``attention_dropout_prob`` applies
    to the attention probabilities in training mode. ``triton_flash_attention`` chose
    SMP's Triton kernel; SDPA computes the same attention here, dropout included (one
    line is logged). ``use_alibi=True`` (which SMP allows only with the Triton kernel)
    means ``attn_mask`` holds the ALiBi bias: it is added to the scores, so a forward
    without ``attn_mask`` is refused.
    """

    def __init__(self, attention_dropout_prob: float = 0.0, scale: float | None = None,
                 triton_flash_attention: bool = False, use_alibi: bool = False):
        super().__init__()
        if use_alibi and not triton_flash_attention:
            raise ValueError("FlashSelfAttention: use_alibi=True needs "
                             "triton_flash_attention=True (as in SMP)")
        if triton_flash_attention:
            notice("FlashSelfAttention(triton_flash_attention=True): there is no Triton "
                   "kernel here; torch's scaled_dot_product_attention computes the same "
                   "attention (ALiBi through attn_mask)")
        self.attention_dropout_prob = attention_dropout_prob
        self.scale = scale
        self.triton_flash_attention = triton_flash_attention
        self.use_alibi = use_alibi

    def forward(self, qkv: Packed, attn_mask: torch.Tensor | None = None, causal: bool = False,
                cast_dtype: torch.dtype | None = None, layout: str = "b h s d") -> torch.Tensor:
        """Attention of ``qkv``: a tuple ``(q, k, v)`` of ``[b, h, s, d]`` (or
        ``[b, s, h, d]``) tensors, or one packed tensor (3 x heads on the head dimension,
        or ``[b, s, 3, h, d]`` / ``[b, 3, h, s, d]``). ``attn_mask``: additive float or
        boolean (``True`` = attend), broadcastable to ``[b, h, s, s]``. ``causal``: the
        lower-triangular mask. ``cast_dtype``: cast q, k, v (and so the output) first.
        Returns ``[b, h, s, d]`` for layout ``"b h s d"``, ``[b, s, h, d]`` for
        ``"b s h d"``."""
        _check_layout(layout)
        if self.use_alibi and attn_mask is None:
            raise ValueError("FlashSelfAttention(use_alibi=True) needs the ALiBi bias as "
                             "attn_mask")
        q, k, v = _to_bhsd(_unpack(qkv, 3, layout, "qkv"), layout, cast_dtype)
        out = attention(q, k, v, mask=attn_mask, causal=causal, scale=self.scale,
                        dropout=self.attention_dropout_prob if self.training else 0.0)
        return out if layout == "b h s d" else out.transpose(1, 2)


class FlashGroupedQueryAttention(nn.Module):
    """Grouped-query attention (SMP v2 ``torch.sagemaker.nn.attn``): fewer key/value heads
    than query heads, each shared by ``h_q / h_kv`` consecutive query heads."""

    def __init__(self, attention_dropout_prob: float = 0.0, scale: float | None = None):
        super().__init__()
        self.attention_dropout_prob = attention_dropout_prob
        self.scale = scale

    def forward(self, q: torch.Tensor, kv: Packed, causal: bool = False,
                cast_dtype: torch.dtype | None = None, layout: str = "b s h d",
                attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Attention of ``q`` (``[b, s, h_q, d]`` or ``[b, h_q, s, d]`` per ``layout``)
        over ``kv``: a tuple ``(k, v)``, or one packed tensor (2 x h_kv on the head
        dimension, or ``[b, s, 2, h_kv, d]`` / ``[b, 2, h_kv, s, d]``). ``causal`` is
        aligned at the bottom right when the lengths differ. ``attn_mask`` as in
        :meth:`FlashSelfAttention.forward`. Returns the output in ``layout``."""
        _check_layout(layout)
        k, v = _unpack(kv, 2, layout, "kv")
        q, k, v = _to_bhsd([q, k, v], layout, cast_dtype)
        out = attention(q, k, v, mask=attn_mask, causal=causal, scale=self.scale,
                        dropout=self.attention_dropout_prob if self.training else 0.0)
        return out if layout == "b h s d" else out.transpose(1, 2)


class FlashAttentionLayer(FlashSelfAttention):
    """SMP v1's ``smp.nn.FlashAttentionLayer`` (v1.15): ``forward(qkv, attn_mask=None,
    causal=False)`` with ``qkv`` ``[b, s, 3, h, d]`` (or a tuple of ``[b, s, h, d]``),
    returning ``[b, h, s, d]``. The scale is ``scale`` if given, else
    ``1 / sqrt(head_size)`` (1 without ``scale_attention_scores``), further divided by
    ``layer_idx + 1`` with ``scale_attn_by_layer_idx``."""

    def __init__(self, attention_dropout_prob: float = 0.1, attention_head_size: int | None = None,
                 scale_attention_scores: bool = True, scale_attn_by_layer_idx: bool = False,
                 layer_idx: int | None = None, scale: float | None = None,
                 triton_flash_attention: bool = False, use_alibi: bool = False):
        if scale_attn_by_layer_idx and layer_idx is None:
            raise ValueError("FlashAttentionLayer: scale_attn_by_layer_idx needs layer_idx")
        super().__init__(attention_dropout_prob, scale, triton_flash_attention, use_alibi)
        self.attention_head_size = attention_head_size
        self.scale_attention_scores = scale_attention_scores
        self.layer_factor = (layer_idx or 0) + 1 if scale_attn_by_layer_idx else 1

    def forward(self, qkv: Packed, attn_mask: torch.Tensor | None = None,  # type: ignore[override]
                causal: bool = False) -> torch.Tensor:
        if self.use_alibi and attn_mask is None:
            raise ValueError("FlashAttentionLayer(use_alibi=True) needs the ALiBi bias as "
                             "attn_mask")
        q, k, v = _to_bhsd(_unpack(qkv, 3, "b s h d", "qkv"), "b s h d", None)
        scale = self.scale
        if scale is None:
            head_size = self.attention_head_size or q.shape[-1]
            scale = (head_size ** -0.5 if self.scale_attention_scores else 1.0) / self.layer_factor
        return attention(q, k, v, mask=attn_mask, causal=causal, scale=scale,
                         dropout=self.attention_dropout_prob if self.training else 0.0)


__all__ = ["FlashAttentionLayer", "FlashGroupedQueryAttention", "FlashSelfAttention",
           "attention"]
