"""What the three SageMaker-style scripts here share with their one-process reference
(tests/e2e/test_sagemaker_scripts.py): a tiny model, synthetic data and the results
file. Like the helper modules of the public SageMaker examples, it is imported by the
scripts from their own directory."""

import contextlib
import json
import os

import torch
from torch import nn

VOCAB, SEQ, GLOBAL_BATCH = 64, 16, 8


def gpt2_config():
    from transformers import GPT2Config

    return GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=4,
                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False)


def llama_config():
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       max_position_embeddings=SEQ, use_cache=False)


@contextlib.contextmanager
def init_empty_weights():
    """What shared-scripts uses accelerate's ``init_empty_weights`` for: parameters on
    the meta device, buffers real (accelerate is not needed here, so this does the
    same in a few lines)."""
    register = nn.Module.register_parameter

    def on_meta(module, name, param):
        register(module, name, param)
        if param is not None:
            module._parameters[name] = nn.Parameter(param.to("meta"),
                                                    requires_grad=param.requires_grad)

    nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def token_batches(steps, seed=1):
    """``steps`` global batches of token ids, (GLOBAL_BATCH, SEQ) each."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(VOCAB, (GLOBAL_BATCH, SEQ), generator=g) for _ in range(steps)]


def rows(batch, index, count):
    """The rows of a global batch that data-parallel rank ``index`` of ``count`` trains."""
    n = batch.shape[0] // count
    return batch[index * n:(index + 1) * n]


def image_batches(steps, seed=1):
    """MNIST-shaped (1x28x28) synthetic images and labels, GLOBAL_BATCH per step."""
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(GLOBAL_BATCH, 1, 28, 28, generator=g),
             torch.randint(10, (GLOBAL_BATCH,), generator=g)) for _ in range(steps)]


def make_optimizer(args, params):
    """AdamW as the public scripts train; SGD with momentum for exact comparisons (Adam
    divides each gradient by its own magnitude, so float round-off in gradients that are
    nearly zero, which any change of summation order brings, becomes a visible step)."""
    if args.optimizer == "sgd":
        return torch.optim.SGD(params, lr=args.lr, momentum=0.9)
    return torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.01)


def write_results(out, losses, state_dict):
    """Rank 0 writes every step's global-batch loss and the full final parameters."""
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "losses.json"), "w") as f:
        json.dump(losses, f)
    torch.save({k: v.detach().cpu() for k, v in state_dict.items()},
               os.path.join(out, "params.pt"))
