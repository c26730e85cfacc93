"""Tensor parallelism vs one process: reference models, Hugging Face models, composition."""

import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import modelparallel as mp
from modelparallel.data import replica_rank_and_size
from modelparallel.models import GPT, GPTConfig, ViT, ViTConfig
from modelparallel.models.gpt import lm_loss
from modelparallel.testing import assert_parity, local_rows, token_batches, train

STEPS = 5
GLOBAL_BATCH = 8
SEQ, VOCAB = 16, 64
GPT_CFG = GPTConfig(vocab_size=VOCAB, max_seq_len=SEQ, d_model=32, n_layers=2, n_heads=4)
VIT_CFG = ViTConfig(image_size=16, patch_size=4, num_classes=10, d_model=32, n_layers=2,
                    n_heads=4)


def hf_model(arch: str) -> nn.Module:
    import transformers as T

    small = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                 num_attention_heads=4, max_position_embeddings=32)
    if arch == "llama":  # grouped-query attention: 4 query heads share 2 key/value heads
        return T.LlamaForCausalLM(T.LlamaConfig(**small, num_key_value_heads=2))
    if arch == "qwen2-tied":
        return T.Qwen2ForCausalLM(T.Qwen2Config(**small, num_key_value_heads=2,
                                                tie_word_embeddings=True))
    if arch == "neox":
        return T.GPTNeoXForCausalLM(T.GPTNeoXConfig(**small, hidden_dropout=0.0,
                                                    attention_dropout=0.0))
    if arch == "gpt2":
        return T.GPT2LMHeadModel(T.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4,
                                              n_positions=32, resid_pdrop=0.0, embd_pdrop=0.0,
                                              attn_pdrop=0.0))
    if arch == "hf-vit":
        return T.ViTForImageClassification(T.ViTConfig(
            image_size=16, patch_size=4, hidden_size=32, num_hidden_layers=2,
            num_attention_heads=4, intermediate_size=64, num_labels=10,
            hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))
    raise ValueError(arch)


HF = ("llama", "qwen2-tied", "neox", "gpt2", "hf-vit")
IMAGES = ("vit", "hf-vit")


class Logits(nn.Module):
    """A Hugging Face model as a function of its inputs returning logits."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, x):
        return self.model(x).logits


def build(arch: str) -> nn.Module:
    torch.manual_seed(0)
    if arch == "gpt":
        return GPT(GPT_CFG)
    if arch == "vit":
        return ViT(VIT_CFG)
    return hf_model(arch)


def batches(arch: str):
    if arch in IMAGES:
        g = torch.Generator().manual_seed(1)
        return [(torch.randn(GLOBAL_BATCH, 3, 16, 16, generator=g),
                 torch.randint(10, (GLOBAL_BATCH,), generator=g)) for _ in range(STEPS)]
    return token_batches(STEPS, GLOBAL_BATCH, SEQ, VOCAB, seed=1)


def loss_fn(arch: str):
    return (lambda logits, y: F.cross_entropy(logits, y)) if arch in IMAGES else lm_loss


def sgd(model):
    return torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)


def clip(model):
    mp.clip_grad_norm_(model, 0.05)


def run(arch: str, model: nn.Module, **kwargs):
    wrapped = Logits(model) if arch in HF else model
    return train(wrapped, batches(arch), optimizer=sgd, loss_fn=loss_fn(arch), **kwargs)


@functools.cache
def reference(arch: str, clipped: bool = False):
    return run(arch, build(arch), before_step=clip if clipped else None)


def parallel_model(arch: str, wrap: str, **transform_kwargs) -> nn.Module:
    model = mp.transform(build(arch), **transform_kwargs)
    if wrap == "shard":
        mp.shard(model)
    elif wrap == "replicate":
        model = mp.replicate(model)
    elif wrap == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        from modelparallel.models.gpt import Block

        model = FSDP(model, auto_wrap_policy=ModuleWrapPolicy({Block}), use_orig_params=True)
    return model


def parity_case(config: dict, arch: str, wrap: str = "", clipped: bool = False, **tp_kwargs):
    mp.init(config)
    model = parallel_model(arch, wrap, **tp_kwargs)
    # the rows mp.data would give this rank: by dp_rank, or by rdp_rank when prescaled
    group = mp.get_rdp_process_group() if config.get("prescaled_batch") else \
        mp.get_dp_process_group()
    result = run(arch, model, replica=replica_rank_and_size(), group=group,
                 loss_context=mp.loss_parallel, before_step=clip if clipped else None)
    assert_parity(result, reference(arch, clipped))
    return result.losses


TP2 = {"tensor_parallel_degree": 2}  # each TP rank reads its own rows (SMP v1's default)
SAME = {**TP2, "prescaled_batch": True}  # the ranks of a TP group read the same rows
CASES = [
    # (world size, config, model, data-parallel wrapper, transform options)
    (2, TP2, "gpt", "", {}),
    (2, SAME, "gpt", "", {}),
    (4, {"tensor_parallel_degree": 4}, "gpt", "", {}),
    (2, SAME, "gpt", "", {"sequence_parallel": True, "loss_parallel": True}),
    (4, {**SAME, "hybrid_shard_degree": 2}, "gpt", "shard", {"loss_parallel": True}),
    (8, {**TP2, "hybrid_shard_degree": 2}, "gpt", "shard", {}),  # tp 2 x hybrid 2 x 2
    (8, {**SAME, "hybrid_shard_degree": 2}, "gpt", "shard", {"sequence_parallel": True}),
    (4, {**TP2, "hybrid_shard_degree": 1}, "gpt", "replicate", {}),  # tp 2 x DDP 2
    (4, TP2, "gpt", "fsdp1", {}),  # SMP v2: transform, then an unchanged FSDP1 script
    (8, {**SAME, "hybrid_shard_degree": 2}, "gpt", "fsdp1", {}),
    (2, TP2, "vit", "", {}),
    (2, TP2, "llama", "", {}),
    (4, {**SAME, "hybrid_shard_degree": 2}, "llama", "shard", {"loss_parallel": True}),
    (2, SAME, "qwen2-tied", "", {"loss_parallel": True}),
    (2, TP2, "neox", "", {}),
    (2, TP2, "gpt2", "", {}),
    (4, {**SAME, "hybrid_shard_degree": 2}, "gpt2", "shard", {"loss_parallel": True}),
    (2, SAME, "hf-vit", "", {}),
]


def case_id(case) -> str:
    world, config, arch, wrap, opts = case
    layout = "x".join(f"{k.split('_')[0]}{v}" for k, v in config.items() if v is not True)
    layout += "-same" if config.get("prescaled_batch") else ""
    extra = "-".join(k.split("_")[0] for k in opts)
    return "-".join(p for p in (f"w{world}", arch, layout, wrap, extra) if p)


@pytest.mark.parametrize("case", CASES, ids=[case_id(c) for c in CASES])
def test_tensor_parallel_parity(workers, case):
    world, config, arch, wrap, opts = case
    if arch in HF:
        pytest.importorskip("transformers")
    losses = workers(world).run(parity_case, config=config, arch=arch, wrap=wrap, **opts)
    assert all(r == losses[0] for r in losses)


@pytest.mark.parametrize("world, config, wrap", [
    (4, {**TP2, "hybrid_shard_degree": 2}, "shard"),
    (4, {**TP2, "hybrid_shard_degree": 1}, "replicate"),
], ids=["tp2-fsdp2", "tp2-ddp2"])
def test_clip_grad_norm_parity(workers, world, config, wrap):
    """Clipping by the global norm over TP and FSDP shards matches one process."""
    workers(world).run(parity_case, config=config, arch="gpt", wrap=wrap, clipped=True)


def clip_norm_case():
    mp.init({**SAME, "hybrid_shard_degree": 2})
    batch = batches("gpt")[0]
    ref = build("gpt")
    lm_loss(ref(batch[0]), batch[1]).backward()
    expected = torch.nn.utils.clip_grad_norm_(ref.parameters(), 1e9)
    model = parallel_model("gpt", "shard")
    inputs, targets = local_rows(batch, mp.rdp_rank(), mp.rdp_size())
    lm_loss(model(inputs), targets).backward()  # FSDP averages: the global-batch gradient
    return float(mp.clip_grad_norm_(model, 1e9)), float(expected)


def test_clip_grad_norm_is_the_global_norm(workers):
    for total, expected in workers(4).run(clip_norm_case):
        assert total == pytest.approx(expected, rel=1e-5)


BIG_VOCAB = 256  # vocabulary shard (128) wider than the hidden size (32): sizes tell apart


def lm_head_case(loss_parallel: bool):
    """The LM head's output shape and the size of every collective of a training step."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Collectives(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.sizes = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.namespace in ("_c10d_functional", "c10d"):
                first = args[0][0] if isinstance(args[0], list | tuple) else args[0]
                self.sizes.append((func._opname, first.numel()))
            return func(*args, **(kwargs or {}))

    mp.init(SAME)
    torch.manual_seed(0)
    model = mp.transform(GPT(GPTConfig(**{**GPT_CFG.__dict__, "vocab_size": BIG_VOCAB})),
                         loss_parallel=loss_parallel)
    shapes = []
    model.lm_head.register_forward_hook(
        lambda m, i, out: shapes.append(tuple(getattr(out, "_local_tensor", out).shape)))
    inputs, targets = token_batches(1, GLOBAL_BATCH, SEQ, BIG_VOCAB)[0]
    with mp.loss_parallel(), Collectives() as seen:
        lm_loss(model(inputs), targets).backward()
    return shapes[0], seen.sizes


def test_lm_head_never_materialises_full_vocabulary_logits(workers):
    shard = GLOBAL_BATCH * SEQ * BIG_VOCAB // 2  # one rank's slice of the logits
    for shape, collectives in workers(2).run(lm_head_case, loss_parallel=True):
        assert shape == (GLOBAL_BATCH, SEQ, BIG_VOCAB // 2)  # each rank computes half
        # Nothing logit-sized is exchanged: the parallel cross-entropy sends row statistics.
        assert collectives and max(n for _, n in collectives) < shard
    for shape, collectives in workers(2).run(lm_head_case, loss_parallel=False):
        # Without loss parallelism the logits are gathered: the check can tell.
        assert shape == (GLOBAL_BATCH, SEQ, BIG_VOCAB)
        assert max(n for _, n in collectives) >= shard
