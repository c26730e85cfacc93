"""The library's random numbers under tensor parallelism (docs/tensor-parallel.md, "Random
numbers"), on every built-in plan, in real gloo processes.

1. Activation checkpointing recomputes exactly the forward's dropout masks: in the same
   layout, the gradients of one forward and backward with and without checkpointing are
   bit-identical in float64 (every rank, every parameter), through torch's checkpoint
   wrapper (reentrant and not), Hugging Face's ``gradient_checkpointing_enable`` (both),
   ``mp.set_activation_checkpointing`` on a ``DistributedModel`` and on pipeline stages.
   Each comparison is checked to be able to fail: the same run with other masks (another
   seed) differs.
2. Which masks agree: replicated activations draw equal masks on the ranks of a
   tensor-parallel group; split ones (heads, sequence shards) and data-parallel replicas
   draw independent masks (about half the positions agree at p = 0.5, where equal masks
   agree everywhere); a second forward draws new masks.
3. Pipeline stages holding different regions leave the script's generator in step.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.tensor import DTensor

import modelparallel as mp
from modelparallel.models import GPT, GPTConfig, ViT, ViTConfig
from modelparallel.parallel.blocks import find_blocks

P = 0.3  # dropout probability of the gradient checks
VOCAB, SEQ = 64, 16
HF_FAMILIES = ("llama", "llama-sdpa", "mistral", "qwen2", "qwen3", "neox", "gpt2", "hf-vit")
MODELS = ("gpt", "gpt-sp", "vit", *HF_FAMILIES, "smp-nn")


def build(name: str, p: float) -> nn.Module:
    """A tiny model of each built-in plan with every dropout at ``p``, seeded."""
    torch.manual_seed(0)
    if name in ("gpt", "gpt-sp"):
        return GPT(GPTConfig(vocab_size=VOCAB, max_seq_len=SEQ, d_model=32, n_layers=2,
                             n_heads=4, dropout=p))
    if name == "vit":
        return ViT(ViTConfig(image_size=8, patch_size=4, num_classes=8, d_model=32, n_layers=2,
                             n_heads=4, dropout=p))
    if name == "smp-nn":
        from modelparallel.smp.v2.nn.tensor_parallel_transformer import TransformerLMHead

        return TransformerLMHead(num_layers=2, num_attention_heads=4, attention_head_size=8,
                                 hidden_size=32, intermediate_size=64, vocab_size=VOCAB,
                                 num_positions=SEQ, attention_dropout_prob=p,
                                 hidden_dropout_prob=p)
    import transformers as T

    gqa = dict(vocab_size=VOCAB, num_hidden_layers=2, hidden_size=32, intermediate_size=64,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
               attention_dropout=p, use_cache=False, attn_implementation="eager")
    if name == "llama":
        return T.LlamaForCausalLM(T.LlamaConfig(**gqa))
    if name == "llama-sdpa":  # dropout inside torch's attention kernel
        return T.LlamaForCausalLM(T.LlamaConfig(**{**gqa, "attn_implementation": "sdpa"}))
    if name == "mistral":
        return T.MistralForCausalLM(T.MistralConfig(**gqa, sliding_window=None))
    if name == "qwen2":
        return T.Qwen2ForCausalLM(T.Qwen2Config(**gqa))
    if name == "qwen3":
        return T.Qwen3ForCausalLM(T.Qwen3Config(**gqa, head_dim=8))
    if name == "neox":
        return T.GPTNeoXForCausalLM(T.GPTNeoXConfig(
            vocab_size=VOCAB, num_hidden_layers=2, hidden_size=32, intermediate_size=64,
            num_attention_heads=4, max_position_embeddings=SEQ, hidden_dropout=p,
            attention_dropout=p, use_cache=False, attn_implementation="eager"))
    if name == "gpt2":
        return T.GPT2LMHeadModel(T.GPT2Config(
            vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=SEQ, resid_pdrop=p,
            embd_pdrop=p, attn_pdrop=p, use_cache=False, attn_implementation="eager"))
    if name == "hf-vit":
        return T.ViTForImageClassification(T.ViTConfig(
            image_size=8, patch_size=4, hidden_size=32, num_hidden_layers=2,
            num_attention_heads=4, intermediate_size=64, hidden_dropout_prob=p,
            attention_probs_dropout_prob=p, attn_implementation="eager"))
    raise ValueError(name)


def inputs(name: str, rows: int = 4) -> torch.Tensor:
    g = torch.Generator().manual_seed(3)
    if name in ("vit", "hf-vit"):
        return torch.randn(rows, 3, 8, 8, generator=g, dtype=torch.float64)
    return torch.randint(VOCAB, (rows, SEQ), generator=g)


def output(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    out = model(x)
    if isinstance(out, tuple):
        out = out[0]
    return getattr(out, "logits", out)


CHECKPOINTING = ("none", "torch", "torch-reentrant", "hf", "hf-reentrant")


def checkpoint(model: nn.Module, how: str) -> None:
    """Activation checkpointing of the model's blocks, the way a script applies it."""
    if how == "none":
        return
    if how.startswith("hf"):
        model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": how == "hf-reentrant"})
        return
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl,
        apply_activation_checkpointing,
        checkpoint_wrapper,
    )

    impl = CheckpointImpl.REENTRANT if how == "torch-reentrant" else CheckpointImpl.NO_REENTRANT
    blocks = {id(b) for b in find_blocks(model)}
    apply_activation_checkpointing(
        model, check_fn=lambda m: id(m) in blocks,
        checkpoint_wrapper_fn=lambda m: checkpoint_wrapper(m, checkpoint_impl=impl))


def local_grads(model: nn.Module) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in model.named_parameters():
        g = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
        if g is not None:
            out[name.replace("_checkpoint_wrapped_module.", "")] = g.detach().clone()
    return out


def transform_grads(name: str, how: str, seed: int = 1) -> dict[str, torch.Tensor]:
    """tsm.transform at tp 2, then one forward and backward in float64."""
    mp.reset()
    mp.init({"tensor_parallel_degree": 2, "prescaled_batch": True})
    model = mp.transform(build(name, P).double(), sequence_parallel=name == "gpt-sp")
    checkpoint(model, how)
    model.train()
    torch.manual_seed(seed)
    output(model, inputs(name)).pow(2).mean().backward()
    return local_grads(model)


def gradients_case(name: str) -> dict[str, str]:
    """Each checkpointing way against none: '' when bit-identical, else what differs."""
    ways = [w for w in CHECKPOINTING[1:] if name in HF_FAMILIES or not w.startswith("hf")]
    if name in ("hf-vit", "smp-nn"):  # their blocks' inputs carry no gradient that torch's
        ways.remove("torch-reentrant")  # reentrant wrapper sees: no gradients, one process too
    base = transform_grads(name, "none")
    found = {way: _differs(base, transform_grads(name, way)) for way in ways}
    found["(other masks)"] = _differs(base, transform_grads(name, "none", seed=2))
    return found


def _differs(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> str:
    if a.keys() != b.keys():
        return f"parameters {sorted(a.keys() ^ b.keys())}"
    bad = [k for k in a if not torch.equal(a[k], b[k])]
    if not bad:
        return ""
    worst = max(((a[k] - b[k]).abs().max() / a[k].abs().max().clamp_min(1e-300)).item()
                for k in bad)
    return f"{len(bad)} of {len(a)} gradients differ (largest relative {worst:.2e})"


@pytest.mark.parametrize("name", MODELS)
def test_checkpointing_recomputes_the_forwards_masks(workers, name):
    for rank, found in enumerate(workers(2).run(gradients_case, name=name)):
        assert found.pop("(other masks)"), f"rank {rank}: other masks gave the same gradients"
        assert found and not any(found.values()), f"rank {rank}: {found}"


# -- SMP v1: DistributedModel, set_activation_checkpointing, pipeline stages ----------------

def v1_grads(name: str, pp: int, checkpointing: bool, seed: int = 1) -> dict[str, torch.Tensor]:
    mp.reset()
    mp.init({"tensor_parallel_degree": 2, "pipeline_parallel_degree": pp, "microbatches": 2,
             "ddp": True})
    model = mp.DistributedModel(build(name, P).double())
    if checkpointing:
        for block in find_blocks(model.module):
            mp.set_activation_checkpointing(block)

    @mp.step
    def step(model, x):
        out = output(model, x)
        model.backward(out.pow(2).mean())

    torch.manual_seed(seed)
    step(model, inputs(name))
    return {k: v for k, v in local_grads(model.module).items()}


def v1_case(name: str, pp: int) -> dict[str, str]:
    base = v1_grads(name, pp, False)
    return {"checkpointed": _differs(base, v1_grads(name, pp, True)),
            "(other masks)": _differs(base, v1_grads(name, pp, False, seed=2))}


@pytest.mark.parametrize(("name", "pp"), [("gpt", 1), ("gpt2", 1), ("llama", 2), ("gpt", 2)])
def test_smp_v1_checkpointing_recomputes_the_forwards_masks(workers, name, pp):
    for rank, found in enumerate(workers(2 * pp).run(v1_case, name=name, pp=pp)):
        assert found["(other masks)"], f"rank {rank}: other masks gave the same gradients"
        assert found["checkpointed"] == "", f"rank {rank}: {found['checkpointed']}"


# -- which masks agree ----------------------------------------------------------------------

def masks_case(name: str, sp: bool) -> dict:
    """Dropout masks of two forwards at tp 2 x 2 data-parallel replicas, every rank seeded
    alike: what each ``nn.Dropout`` zeroed, and draws inside each attention (a region)."""
    mp.init({"tensor_parallel_degree": 2})
    torch.manual_seed(0)  # the same seed on every rank
    model = mp.transform(build(name, 0.5), sequence_parallel=sp)
    model.train()
    masks: dict[str, list[torch.Tensor]] = {}

    def zeroed(path):
        def hook(module, args, out):
            out = out.to_local() if isinstance(out, DTensor) else out
            masks.setdefault(path, []).append((out == 0).flatten())
        return hook

    def draw(path):
        def hook(module, args):
            masks.setdefault(path, []).append(torch.rand(512) < 0.5)
        return hook

    for path, module in model.named_modules():
        if isinstance(module, nn.Dropout):
            module.register_forward_hook(zeroed(path))
        elif path.endswith(("attn.o_proj", "attn.c_proj")):  # inside the attention region
            module.register_forward_pre_hook(draw(path))
    for _ in range(2):
        output(model, inputs(name, rows=4))
    return {"tp": mp.tp_rank(), "dp": mp.rdp_rank(), "masks": masks}


def agreement(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a == b).float().mean().item()


def independent(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Masks at p = 0.5 drawn apart agree on about half the positions."""
    return 0.4 < agreement(a, b) < 0.6


@pytest.mark.parametrize(("name", "sp", "replicated", "split"), [
    # the reference GPT: the attention's draws are split (heads); with sequence parallelism
    # the embeddings' and MLP's dropout act on each rank's positions
    ("gpt", False, ["drop", "blocks.0.mlp.dropout"], ["blocks.0.attn.o_proj"]),
    ("gpt", True, [], ["drop", "blocks.0.mlp.dropout", "blocks.1.attn.o_proj"]),
    # GPT-2: the attention output's dropout is a REPLICATED region, its heads SHARDED
    ("gpt2", False, ["transformer.drop", "transformer.h.0.attn.resid_dropout",
                     "transformer.h.1.mlp.dropout"], ["transformer.h.0.attn.c_proj"]),
])
def test_masks_agree_where_activations_are_replicated_only(workers, name, sp, replicated,
                                                           split):
    results = workers(4).run(masks_case, name=name, sp=sp)
    at = {(r["tp"], r["dp"]): r["masks"] for r in results}
    for path in replicated + split:
        first, second = at[0, 0][path]
        assert independent(first, second), f"{path}: a second forward repeats the masks"
        peer = at[1, 0][path][0]
        if path in replicated:
            assert torch.equal(first, peer), f"{path}: tensor-parallel ranks draw apart"
        else:
            assert independent(first, peer), f"{path}: tensor-parallel ranks draw alike"
        # data-parallel replicas read other samples: the library's regions draw apart for
        # them; outside regions the script's generator draws (seeded alike here)
        replica = at[0, 1][path][0]
        library = path in split or "resid_dropout" in path
        assert independent(first, replica) if library else torch.equal(first, replica), \
            f"{path}: data-parallel replicas"


# -- pipeline stages stay in step -----------------------------------------------------------

def pipeline_generator_case() -> dict:
    """pp 2 x tp 2, three blocks (the stages hold different regions, and only the first
    the embeddings' dropout): the script's generator after two steps."""
    mp.init({"tensor_parallel_degree": 2, "pipeline_parallel_degree": 2, "microbatches": 2})
    torch.manual_seed(0)
    model = mp.DistributedModel(GPT(GPTConfig(vocab_size=VOCAB, max_seq_len=SEQ, d_model=32,
                                              n_layers=3, n_heads=4, dropout=0.3)))

    @mp.step
    def step(model, x):
        model.backward(model(x).pow(2).mean())

    for _ in range(2):
        step(model, inputs("gpt"))
    return {"pp": mp.pp_rank(), "state": torch.get_rng_state()}


def test_pipeline_stages_leave_the_scripts_generator_in_step(workers):
    results = workers(4).run(pipeline_generator_case)
    assert {r["pp"] for r in results} == {0, 1}
    first = results[0]["state"]
    assert all(torch.equal(r["state"], first) for r in results), \
        "the stages' generators drifted apart"


def no_dropout_case() -> list[float]:
    """tp 2, no dropout: what the script draws from its generator after each forward
    (SMP v2's shared scripts make their synthetic batches so)."""
    mp.init({"tensor_parallel_degree": 2, "prescaled_batch": True})
    torch.manual_seed(0)
    model = mp.transform(build("llama", 0.0))
    model.train()
    draws = []
    for _ in range(3):
        output(model, inputs("llama")).sum().backward()
        draws.append(torch.rand(()).item())
    return draws


def test_a_model_that_draws_nothing_leaves_the_scripts_generator_alone(workers):
    torch.manual_seed(0)
    model = build("llama", 0.0)
    model.train()
    one_process = []
    for _ in range(3):
        output(model, inputs("llama")).sum().backward()
        one_process.append(torch.rand(()).item())
    assert workers(2).run(no_dropout_case) == [one_process] * 2
