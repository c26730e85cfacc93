"""The models of the parity matrix: tiny, built from configs with random weights.

Every size a layout can split divides 8 (the largest degree of the matrix): 8 query
heads (16 with 8 key/value heads for grouped-query attention), MLP widths and the
vocabulary. The number of layers grows with the pipeline stages a case needs. Hugging
Face and reference models alike are wrapped in :class:`~.keyed.Keyed`, so every model maps
the inputs of :func:`batches` to logits and its dropout is keyed by sample.

The mixture-of-experts models (:data:`MOE_MODELS`: Mixtral, Qwen2-MoE with its shared
expert and a dense layer, Qwen3-MoE with a dense layer; hidden 64, 2 layers, 4 experts,
top-2) are the expert-parallel axis's, trained in float64 so that round-off cannot flip a
router's top-k choice between a layout and one process.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from modelparallel.models import GPT, GPTConfig, ViT, ViTConfig
from parity_matrix.keyed import ATTENTION, Keyed, encode, register_attention

VOCAB, SEQ, IMAGE, CLASSES = 64, 8, 8, 8
HF_MODELS = ("gpt2", "llama", "mistral", "qwen2", "qwen3", "neox")
MODELS = ("gpt", "vit", *HF_MODELS, "noplan", "partial", "tied")
# Hugging Face mixture-of-experts models (the expert-parallel axis's, not the model axis's)
MOE_MODELS = ("mixtral", "qwen2moe", "qwen3moe")
EXPERTS = 4  # per mixture-of-experts layer, each token choosing 2
ROUTER_LOSS_COEF = 0.02  # the load-balancing loss's weight when it is on
IMAGE_MODELS = ("vit", "hf-vit")
TIED_MODELS = ("tied", "gpt2")  # input and output embeddings share one parameter
# every model with a built-in tensor-parallel plan (hf-vit is not a matrix axis value)
BUILTIN_PLAN_MODELS = ("gpt", "vit", *HF_MODELS, "hf-vit")


class Residual(nn.Module):
    """A block no tensor-parallel plan knows: a residual MLP."""

    def __init__(self, width: int, dropout: float):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc_in = nn.Linear(width, 2 * width)
        self.fc_out = nn.Linear(2 * width, width)
        self.drop = nn.Dropout(dropout)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.drop(self.fc_out(F.gelu(self.fc_in(self.norm(h)))))


class NoPlan(nn.Module):
    """A language model made only of modules without a tensor-parallel plan."""

    def __init__(self, layers: int, dropout: float, width: int = 32):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, width)
        self.layers = nn.ModuleList(Residual(width, dropout) for _ in range(layers))
        self.head = nn.Linear(width, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


def build(model: str, layers: int, dropout: bool, seed: int = 0, unused: bool = False
          ) -> nn.Module:
    """The single-device model ``model`` with ``layers`` repeated layers, seeded: a
    function of :func:`batches`' inputs returning logits, whose dropout masks are keyed
    by sample (``keyed.py``), so that one process draws what any layout draws.
    ``unused``: with a parameter the forward never uses."""
    torch.manual_seed(seed)
    keyed = _build(model, layers, dropout)
    if unused:
        keyed.unused = nn.Parameter(torch.ones(4))
    return keyed


def _build(model: str, layers: int, dropout: bool) -> nn.Module:
    p = 0.1 if dropout else 0.0
    if model in ("gpt", "partial", "tied"):
        inner: nn.Module = GPT(GPTConfig(
            vocab_size=VOCAB, max_seq_len=SEQ, d_model=32, n_layers=layers, n_heads=8,
            dropout=p, tie_embeddings=model == "tied"))
    elif model == "vit":
        inner = ViT(ViTConfig(image_size=IMAGE, patch_size=4, num_classes=CLASSES, d_model=32,
                              n_layers=layers, n_heads=8, dropout=p))
    elif model == "noplan":
        inner = NoPlan(layers, p)
    else:
        return Keyed(_hf(model, layers, p), VOCAB, hugging_face=True)
    return Keyed(inner, VOCAB, hugging_face=False)


def _hf(model: str, layers: int, p: float) -> nn.Module:
    import transformers as T

    register_attention()
    # keyed attention drops attention weights by sample; without dropout it is eager
    # attention, which context parallelism replaces by ring attention (it refuses to
    # replace an attention implementation it does not know)
    attention = ATTENTION if p else "eager"
    common: dict[str, Any] = dict(vocab_size=VOCAB, num_hidden_layers=layers,
                                  max_position_embeddings=2 * SEQ, use_cache=False,
                                  attn_implementation=attention)
    # grouped-query attention: 16 query heads share 8 key/value heads (head size 4)
    gqa: dict[str, Any] = dict(common, hidden_size=64, intermediate_size=128,
                               num_attention_heads=16, num_key_value_heads=8,
                               attention_dropout=p)
    if model == "gpt2":
        gpt2: dict[str, Any] = dict(
            vocab_size=VOCAB, n_embd=32, n_layer=layers, n_head=8, n_positions=2 * SEQ,
            resid_pdrop=p, embd_pdrop=p, attn_pdrop=p, use_cache=False, bos_token_id=0,
            eos_token_id=0, attn_implementation=attention)
        return T.GPT2LMHeadModel(T.GPT2Config(**gpt2))
    if model == "llama":
        return T.LlamaForCausalLM(T.LlamaConfig(**gqa))
    if model == "mistral":
        return T.MistralForCausalLM(T.MistralConfig(**gqa, sliding_window=None))
    if model == "qwen2":
        return T.Qwen2ForCausalLM(T.Qwen2Config(**gqa))
    if model == "qwen3":  # q_norm / k_norm act on each rank's heads
        return T.Qwen3ForCausalLM(T.Qwen3Config(**gqa, head_dim=4))
    if model in MOE_MODELS:
        return _moe(model, gqa)
    if model == "hf-vit":
        return T.ViTForImageClassification(T.ViTConfig(
            image_size=IMAGE, patch_size=4, hidden_size=32, num_hidden_layers=layers,
            num_attention_heads=8, intermediate_size=64,
            num_labels=CLASSES,  # type: ignore[call-arg]  # PretrainedConfig's keyword
            hidden_dropout_prob=p, attention_probs_dropout_prob=p,
            attn_implementation=attention))
    if model == "neox":
        return T.GPTNeoXForCausalLM(T.GPTNeoXConfig(
            **common, hidden_size=32, intermediate_size=128, num_attention_heads=8,
            rope_parameters={"rope_theta": 10000.0, "partial_rotary_factor": 1.0,
                             "rope_type": "default"},
            hidden_dropout=p, attention_dropout=p))
    raise ValueError(f"unknown model {model!r}")


def _moe(model: str, gqa: dict[str, Any]) -> nn.Module:
    """A tiny mixture-of-experts causal LM: 4 experts, top-2, its attention's dropout the
    zoo's (the only dropout these models have); eager experts (grouped_mm has no float64
    kernel)."""
    import transformers as T

    moe = dict(gqa, num_experts_per_tok=2, experts_implementation="eager",
               tie_word_embeddings=False)
    del moe["intermediate_size"]
    if model == "mixtral":
        return T.MixtralForCausalLM(T.MixtralConfig(
            **moe, intermediate_size=128, num_local_experts=EXPERTS, sliding_window=None))
    if model == "qwen2moe":  # a shared expert and its gate; layer 1 dense; weights unnormalized
        return T.Qwen2MoeForCausalLM(T.Qwen2MoeConfig(
            **moe, intermediate_size=96, moe_intermediate_size=32,
            shared_expert_intermediate_size=48, num_experts=EXPERTS, norm_topk_prob=False,
            decoder_sparse_step=1, mlp_only_layers=[1]))
    return T.Qwen3MoeForCausalLM(T.Qwen3MoeConfig(  # layer 0 dense: every second is sparse
        **moe, intermediate_size=96, moe_intermediate_size=32, num_experts=EXPERTS,
        norm_topk_prob=True, decoder_sparse_step=2, head_dim=4))


def turn_on_router_loss(model: nn.Module) -> None:
    """One process's load-balancing loss, as ``MoEConfig(moe_load_balancing="aux_loss",
    moe_aux_loss_coeff=ROUTER_LOSS_COEF)`` turns it on: the Hugging Face model adds it."""
    inner = model.model if isinstance(model, Keyed) else model
    config: Any = inner.config
    config.output_router_logits = True
    inner.router_aux_loss_coef = ROUTER_LOSS_COEF


def blocks_of(model: nn.Module) -> list[nn.Module]:
    """The repeated layers (FSDP units, checkpointed modules)."""
    from modelparallel.parallel.blocks import find_blocks

    return find_blocks(model)


def keep_first_block_whole(model: nn.Module) -> None:
    """``partial``: only some blocks have a plan (the first is marked to stay whole)."""
    from modelparallel.parallel.tensor.plans import set_tensor_parallelism

    set_tensor_parallelism(blocks_of(model)[0], False)


IGNORE = -100  # the target of a padded position


def batches(model: str, steps: int, rows: int, seed: int = 1, padded: bool = False
            ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(inputs, targets) of ``rows`` samples for each step; every sample carries its
    number (``keyed.encode``), counted over the steps. ``padded``: rows end in 0 to
    ``SEQ`` padded targets (:data:`IGNORE`; some rows wholly), images are left out of
    the loss now and then, so ranks and microbatches hold uneven numbers of targets."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for step in range(steps):
        if model in IMAGE_MODELS:
            x, y = (torch.randn(rows, 3, IMAGE, IMAGE, generator=g),
                    torch.randint(CLASSES, (rows,), generator=g))
            if padded:
                y[torch.arange(rows) % 3 == (step + 1) % 3] = IGNORE
        else:
            seq = torch.randint(VOCAB, (rows, SEQ + 1), generator=g)
            x, y = seq[:, :-1], seq[:, 1:].clone()
            if padded:
                for r in range(rows):
                    y[r, SEQ - (5 * r + step) % (SEQ + 1):] = IGNORE
        out.append((encode(x, step * rows, VOCAB), y))
    return out


def loss_fn(model: str, padded: bool = False
            ) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The mean loss, or (``padded``) the sum over the targets that are not padding."""
    def loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        logits = logits.float()
        if model not in IMAGE_MODELS:
            logits, y = logits.reshape(-1, logits.size(-1)), y.reshape(-1)
        return F.cross_entropy(logits, y, ignore_index=IGNORE,
                               reduction="sum" if padded else "mean")
    return loss
