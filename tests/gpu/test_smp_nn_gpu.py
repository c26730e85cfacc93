"""smp.nn / tsm.nn.attn on a CUDA GPU (SDPA's CUDA kernels) against the same math in
float32; skipped where there is none."""

import math

import pytest
import torch

from modelparallel.smp.nn import DistributedTransformerLMHead
from modelparallel.smp.v2.nn.flash_attention import FlashGroupedQueryAttention, FlashSelfAttention

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs a CUDA GPU (run on a GPU machine)")
# bf16 keeps 8 bits of mantissa: attention outputs of O(1) values within a few 1e-2
TOL = {torch.float32: 2e-5, torch.bfloat16: 3e-2}


def reference(q, k, v, mask=None, causal=False):
    k = k.repeat_interleave(q.shape[1] // k.shape[1], 1)
    v = v.repeat_interleave(q.shape[1] // v.shape[1], 1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if causal:
        keep = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~keep, float("-inf"))
    if mask is not None:
        scores = scores + mask
    return scores.softmax(-1) @ v


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_modules_on_cuda(dtype):
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(2, 8, 128, 64, device="cuda", generator=g) for _ in range(3))
    mask = torch.zeros(2, 1, 1, 128, device="cuda")
    mask[0, ..., 100:] = -1e4
    attn = FlashSelfAttention()
    for m in (None, mask):
        out = attn((q, k, v), attn_mask=m, causal=True, cast_dtype=dtype)
        assert out.dtype == dtype
        assert (out.float() - reference(q, k, v, m, True)).abs().max() < TOL[dtype]
    kv = (k[:, :2].transpose(1, 2), v[:, :2].transpose(1, 2))  # 8 query heads, 2 kv heads
    out = FlashGroupedQueryAttention()(q.transpose(1, 2), kv, causal=True, cast_dtype=dtype)
    want = reference(q, k[:, :2], v[:, :2], None, True)
    assert (out.float().transpose(1, 2) - want).abs().max() < TOL[dtype]


def test_lm_head_on_cuda_matches_cpu():
    args = dict(num_layers=2, num_attention_heads=4, attention_head_size=16, hidden_size=64,
                intermediate_size=128, vocab_size=128, num_positions=64,
                attention_dropout_prob=0.0, hidden_dropout_prob=0.0, causal_mask_size=64,
                pre_layernorm=True, post_layernorm=True)
    torch.manual_seed(0)
    cpu = DistributedTransformerLMHead(**args)
    gpu = DistributedTransformerLMHead(**args).cuda()
    gpu.load_state_dict(cpu.state_dict())
    ids = torch.randint(128, (4, 64))
    mask = torch.ones(4, 64)
    mask[1, 50:] = 0
    want, _ = cpu((ids, mask, None, None, ids))
    want.backward()
    got, _ = gpu((ids.cuda(), mask.cuda(), None, None, ids.cuda()))
    got.backward()
    assert abs(got.item() - want.item()) < 1e-4 * abs(want.item())
    for (name, p), ref in zip(gpu.named_parameters(), cpu.parameters(), strict=True):
        assert (p.grad.cpu() - ref.grad).abs().max() < 1e-4 * ref.grad.abs().max() + 1e-7, name
    with torch.autocast("cuda", torch.bfloat16):
        half, _ = gpu((ids.cuda(), mask.cuda(), None, None, ids.cuda()))
    assert abs(half.item() - want.item()) < 2e-2 * abs(want.item())
