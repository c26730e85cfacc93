"""The tensor-parallel plans of the reference models and of Hugging Face families.

Models own their plans: they are registered here (imported with ``modelparallel``),
and ``parallel/tensor`` applies whatever is registered without knowing any model.

Megatron's layout throughout: attention splits by heads (q/k/v column-parallel, the
output projection row-parallel), MLPs column-then-row, embeddings vocabulary-parallel,
the LM head column-parallel. Hugging Face classes are named, not imported, so
``transformers`` stays optional.
"""

from __future__ import annotations

from typing import Any

from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
)

from modelparallel.models.gpt import GPT, Block
from modelparallel.models.vit import ViT
from modelparallel.parallel.tensor.layouts import lm_head, shared_input, vocab_embedding
from modelparallel.parallel.tensor.plans import (
    REPLICATED,
    SHARDED,
    PlanFactory,
    TPOptions,
    TPPlan,
    builtin,
)
from modelparallel.parallel.tensor.styles import ColwiseConv1D, FusedColwiseConv1D, RowwiseConv1D

# -- the reference models (modelparallel.models) --------------------------------------

@builtin(Block)
def _reference_block(block: Block, o: TPOptions) -> TPPlan:
    row = RowwiseParallel(output_layouts=Shard(1), use_local_output=False) \
        if o.sequence_parallel else RowwiseParallel()
    styles = {"attn.q_proj": ColwiseParallel(), "attn.k_proj": ColwiseParallel(),
              "attn.v_proj": ColwiseParallel(), "attn.o_proj": row,
              "mlp.fc_in": ColwiseParallel(), "mlp.fc_out": row}
    if o.sequence_parallel:
        gather = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
        styles |= {"ln_1": SequenceParallel(), "ln_2": SequenceParallel(),
                   "attn": gather, "mlp": gather}
    else:
        styles["attn"] = shared_input()
    # attention dropout acts on each rank's heads; with sequence parallelism the MLP's
    # output dropout acts on each rank's positions
    rng = {"attn": SHARDED} | ({"mlp.dropout": SHARDED} if o.sequence_parallel else {})
    return TPPlan(styles=styles,
                  sizes={"attention heads": block.attn.n_heads,
                         "MLP width": block.mlp.fc_in.out_features},
                  rng=rng, sequence_parallel=True)


@builtin(GPT)
def _reference_gpt(model: GPT, o: TPOptions) -> TPPlan:
    styles = {"tok_emb": vocab_embedding(o), "lm_head": lm_head(o)}
    sizes = {"vocabulary": model.cfg.vocab_size}
    rng = {}
    if o.sequence_parallel:
        styles |= {"pos_emb": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(0),
                                              use_local_output=False),
                   "ln_f": SequenceParallel()}
        sizes["positions"] = model.cfg.max_seq_len
        rng["drop"] = SHARDED  # the embeddings' dropout acts on each rank's positions
    return TPPlan(styles=styles, sizes=sizes, rng=rng, sequence_parallel=True)


@builtin(ViT)
def _reference_vit(model: ViT, o: TPOptions) -> TPPlan:
    return TPPlan(styles={})  # the blocks are split; patch embedding and head stay whole


# -- Hugging Face transformers ---------------------------------------------------------

def _attention(layer: Any) -> TPPlan:
    """A Llama-style layer's attention split by heads (its MLP left to the caller)."""
    cfg = layer.self_attn.config
    return TPPlan(
        styles={"self_attn": shared_input(hidden_states=None),
                "self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
                "self_attn.v_proj": ColwiseParallel(), "self_attn.o_proj": RowwiseParallel()},
        sizes={"attention heads": cfg.num_attention_heads,
               "key/value heads": cfg.num_key_value_heads},
        rng={"self_attn": SHARDED})


def _split_mlp(plan: TPPlan, path: str, mlp: Any, label: str) -> None:
    """Add a gated MLP (gate_proj, up_proj, down_proj) at ``path``, column-then-row."""
    plan.styles |= {path: shared_input(), f"{path}.gate_proj": ColwiseParallel(),
                    f"{path}.up_proj": ColwiseParallel(),
                    f"{path}.down_proj": RowwiseParallel()}
    plan.sizes[label] = mlp.gate_proj.out_features


@builtin("LlamaDecoderLayer", "MistralDecoderLayer", "Qwen2DecoderLayer", "Qwen3DecoderLayer")
def _llama_layer(layer: Any, o: TPOptions) -> TPPlan:
    plan = _attention(layer)
    _split_mlp(plan, "mlp", layer.mlp, "MLP width")
    return plan


@builtin("MixtralDecoderLayer", "Qwen2MoeDecoderLayer", "Qwen3MoeDecoderLayer")
def _moe_layer(layer: Any, o: TPOptions) -> TPPlan:
    # a sparse block's router and experts stay whole on every tensor-parallel rank, which
    # all route the same tokens (expert parallelism splits the experts over data-parallel
    # ranks: docs/expert-parallel.md, "With tensor parallelism"); a shared expert and a
    # dense layer's MLP split as Llama's
    plan = _attention(layer)
    shared = getattr(layer.mlp, "shared_expert", None)
    if not hasattr(layer.mlp, "experts"):
        _split_mlp(plan, "mlp", layer.mlp, "MLP width")
    elif shared is not None:
        _split_mlp(plan, "mlp.shared_expert", shared, "shared expert width")
    return plan


@builtin("GPTNeoXLayer")
def _neox_layer(layer: Any, o: TPOptions) -> TPPlan:
    # query_key_value is laid out per head ([q k v] of head 0, then head 1, ...), so a
    # contiguous column split keeps whole heads.
    return TPPlan(
        styles={"attention.query_key_value": ColwiseParallel(),
                "attention.dense": RowwiseParallel(),
                "mlp.dense_h_to_4h": ColwiseParallel(), "mlp.dense_4h_to_h": RowwiseParallel()},
        sizes={"attention heads": layer.attention.config.num_attention_heads,
               "MLP width": layer.mlp.dense_h_to_4h.out_features},
        rng={"attention": SHARDED})


@builtin("GPT2Block")
def _gpt2_block(block: Any, o: TPOptions) -> TPPlan:
    if getattr(block, "crossattention", None) is not None:
        raise NotImplementedError("GPT-2 with cross-attention (add_cross_attention=True) has no "
                                  "tensor-parallel plan yet")
    return TPPlan(
        styles={"attn.c_attn": FusedColwiseConv1D(chunks=3), "attn.c_proj": RowwiseConv1D(),
                "mlp.c_fc": ColwiseConv1D(), "mlp.c_proj": RowwiseConv1D()},
        sizes={"attention heads": block.attn.num_heads, "MLP width": block.mlp.c_fc.nf},
        divide_attrs=("attn.split_size", "attn.num_heads"),
        rng={"attn": SHARDED, "attn.resid_dropout": REPLICATED})


@builtin("ViTLayer")
def _vit_layer(layer: Any, o: TPOptions) -> TPPlan:
    return TPPlan(
        styles={"attention": PrepareModuleInput(input_layouts=(Replicate(), None),
                                                desired_input_layouts=(Replicate(), None)),
                "attention.q_proj": ColwiseParallel(), "attention.k_proj": ColwiseParallel(),
                "attention.v_proj": ColwiseParallel(), "attention.o_proj": RowwiseParallel(),
                "mlp.fc1": ColwiseParallel(), "mlp.fc2": RowwiseParallel()},
        sizes={"attention heads": layer.attention.num_attention_heads,
               "MLP width": layer.mlp.fc1.out_features},
        rng={"attention": SHARDED})


def _embedding_plan(attr: str) -> PlanFactory:
    def plan(model: Any, o: TPOptions) -> TPPlan:
        return TPPlan(styles={attr: vocab_embedding(o)},
                      sizes={"vocabulary": getattr(model, attr).num_embeddings})
    return plan


def _head_plan(*attrs: str) -> PlanFactory:
    def plan(model: Any, o: TPOptions) -> TPPlan:
        attr = next(a for a in attrs if hasattr(model, a))  # renamed across HF versions
        return TPPlan(styles={attr: lm_head(o)},
                      sizes={"vocabulary": getattr(model, attr).out_features})
    return plan


builtin("LlamaModel", "MistralModel", "Qwen2Model", "Qwen3Model", "MixtralModel",
        "Qwen2MoeModel", "Qwen3MoeModel")(_embedding_plan("embed_tokens"))
builtin("GPT2Model")(_embedding_plan("wte"))
builtin("GPTNeoXModel")(_embedding_plan("embed_in"))
builtin("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
        "MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM",
        "GPT2LMHeadModel")(_head_plan("lm_head"))
builtin("GPTNeoXForCausalLM")(_head_plan("lm_head", "embed_out"))
