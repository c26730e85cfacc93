"""Models for ``modelparallel plan --model examples/plan/models.py:FUNCTION``: each
function returns the single-device model, with random weights."""

from modelparallel.models.gpt import GPT, GPTConfig


def tiny_gpt():
    """The test suite's GPT: 2 layers of width 64 (about 0.1 M parameters)."""
    return GPT(GPTConfig(vocab_size=256, d_model=64, n_layers=2, n_heads=4, max_seq_len=128))


def gpt_1b():
    """A GPT of about 1.3 B parameters (GPT-2 XL's shape: 24 layers of width 2048)."""
    return GPT(GPTConfig(vocab_size=50304, d_model=2048, n_layers=24, n_heads=16,
                         max_seq_len=2048))


def tiny_llama():
    """A Hugging Face Llama of 2 layers of width 64 (grouped-query attention: 4 query, 2
    key/value heads), for long sequences: context parallelism plans its layouts."""
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16384,
        use_cache=False, tie_word_embeddings=False, attn_implementation="sdpa")
    return transformers.LlamaForCausalLM(config)
