"""SMP v2's ``torch.sagemaker.nn.attn`` (and SMP v1's ``smp.nn.FlashAttentionLayer``) on
torch's SDPA, against softmax attention written out by hand."""

import math

import pytest
import torch

from modelparallel.smp import nn as smp_nn
from modelparallel.smp.v2.nn.flash_attention import FlashGroupedQueryAttention, FlashSelfAttention

TOL = dict(rtol=1e-5, atol=1e-6)


def manual_attention(q, k, v, mask=None, causal=False, scale=None):
    """softmax(q k^T * scale + mask) v on [b, h, s, d]; causal aligned bottom-right."""
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    scores = q @ k.transpose(-1, -2) * scale
    if causal:
        sq, sk = scores.shape[-2:]
        keep = torch.ones(sq, sk, dtype=torch.bool).tril(sk - sq)
        scores = scores.masked_fill(~keep, float("-inf"))
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool \
            else scores + mask
    return scores.softmax(-1) @ v


def qkv(b=2, h=4, s=6, d=8, hk=None, sk=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    hk, sk = hk or h, sk or s
    return (torch.randn(b, h, s, d, generator=g), torch.randn(b, hk, sk, d, generator=g),
            torch.randn(b, hk, sk, d, generator=g))


# -- SMP v2: torch.sagemaker.nn.attn ----------------------------------------------------

@pytest.mark.parametrize("causal", [False, True])
def test_flash_self_attention_equals_softmax_attention(causal):
    q, k, v = qkv()
    want = manual_attention(q, k, v, causal=causal)
    attn = FlashSelfAttention()
    torch.testing.assert_close(attn((q, k, v), causal=causal), want, **TOL)
    # packed: 3 x heads on the head dim, or FlashAttention's [b, 3, h, s, d]
    torch.testing.assert_close(attn(torch.cat([q, k, v], 1), causal=causal), want, **TOL)
    torch.testing.assert_close(attn(torch.stack([q, k, v], 1), causal=causal), want, **TOL)
    # "b s h d" in, "b s h d" out
    bshd = [t.transpose(1, 2) for t in (q, k, v)]
    out = attn(tuple(bshd), causal=causal, layout="b s h d")
    torch.testing.assert_close(out, want.transpose(1, 2), **TOL)
    torch.testing.assert_close(attn(torch.stack(bshd, 2), causal=causal, layout="b s h d"),
                               want.transpose(1, 2), **TOL)


def test_flash_self_attention_masks_scale_and_dtype():
    q, k, v = qkv()
    additive = torch.zeros(2, 1, 1, 6)
    additive[0, ..., 4:] = -1e4  # first sequence: last two keys padded
    keep = torch.rand(2, 4, 6, 6, generator=torch.Generator().manual_seed(3)) > 0.3
    keep[..., 0] = True  # no row fully masked
    attn = FlashSelfAttention(scale=0.5)
    torch.testing.assert_close(attn((q, k, v), attn_mask=additive, causal=True),
                               manual_attention(q, k, v, additive, True, 0.5), **TOL)
    torch.testing.assert_close(attn((q, k, v), attn_mask=keep),
                               manual_attention(q, k, v, keep, False, 0.5), **TOL)
    out = attn((q, k, v), cast_dtype=torch.float64)
    assert out.dtype == torch.float64
    torch.testing.assert_close(out, manual_attention(*(t.double() for t in (q, k, v)),
                                                     scale=0.5))


def test_flash_attention_dropout_only_in_training():
    q, k, v = qkv()
    attn = FlashSelfAttention(attention_dropout_prob=0.5)
    torch.testing.assert_close(attn.eval()((q, k, v)), manual_attention(q, k, v), **TOL)
    torch.manual_seed(0)
    first = attn.train()((q, k, v))
    torch.manual_seed(0)
    assert torch.equal(first, attn((q, k, v)))  # the global generator decides the mask
    assert not torch.allclose(first, manual_attention(q, k, v))


def test_v1_flash_attention_layer_scales_by_layer():
    q, k, v = qkv()
    layer = smp_nn.FlashAttentionLayer(attention_dropout_prob=0.0, scale_attn_by_layer_idx=True,
                                       layer_idx=2)
    packed = torch.stack([t.transpose(1, 2) for t in (q, k, v)], 2)  # [b, s, 3, h, d]
    torch.testing.assert_close(layer(packed, causal=True),  # [b, h, s, d] out
                               manual_attention(q, k, v, causal=True, scale=8 ** -0.5 / 3),
                               **TOL)
    unscaled = smp_nn.FlashAttentionLayer(attention_dropout_prob=0.0,
                                          scale_attention_scores=False)
    torch.testing.assert_close(unscaled(packed), manual_attention(q, k, v, scale=1.0), **TOL)


def test_grouped_query_attention_shares_kv_heads():
    q, k, v = qkv(h=4, hk=2)
    want = manual_attention(q, k, v, causal=True)
    gqa = FlashGroupedQueryAttention()
    bshd = [t.transpose(1, 2) for t in (q, k, v)]
    torch.testing.assert_close(gqa(bshd[0], (bshd[1], bshd[2]), causal=True),
                               want.transpose(1, 2), **TOL)
    torch.testing.assert_close(gqa(bshd[0], torch.cat(bshd[1:], 2), causal=True),
                               want.transpose(1, 2), **TOL)
    torch.testing.assert_close(gqa(q, torch.stack([k, v], 1), causal=True, layout="b h s d"),
                               want, **TOL)
    # decoding: 2 queries over 6 keys, the causal mask aligned at the bottom right
    q2, k2, v2 = qkv(h=4, hk=2, s=2, sk=6)
    torch.testing.assert_close(gqa(q2, (k2, v2), causal=True, layout="b h s d"),
                               manual_attention(q2, k2, v2, causal=True), **TOL)


def test_flash_attention_refusals():
    q, k, v = qkv()
    with pytest.raises(ValueError, match="triton_flash_attention"):
        FlashSelfAttention(use_alibi=True)
    alibi = FlashSelfAttention(triton_flash_attention=True, use_alibi=True)
    with pytest.raises(ValueError, match="ALiBi bias"):
        alibi((q, k, v))
    bias = -torch.arange(6.0).expand(2, 4, 6, 6)  # an ALiBi-like bias is added to scores
    torch.testing.assert_close(alibi((q, k, v), attn_mask=bias, causal=True),
                               manual_attention(q, k, v, bias, True), **TOL)
    with pytest.raises(ValueError, match="layout"):
        FlashSelfAttention()((q, k, v), layout="s b h d")
    with pytest.raises(ValueError, match="not divisible"):
        FlashGroupedQueryAttention()(*qkv(h=4, hk=3)[:1], qkv(h=3)[1:], layout="b h s d")
