"""torch's ``clip_grad_norm_`` on a model whose gradient norms it cannot add up, bound by
name before ``mp.init()`` (which routes ``torch.nn.utils.clip_grad_norm_`` called later to
``mp.clip_grad_norm_``): the launcher's summary says in one line to call
``mp.clip_grad_norm_``."""


def test_torch_clip_grad_norm_of_a_tensor_parallel_model_names_mp_clip_grad_norm(
        modelparallel, script):
    path = script("""
        import torch
        from torch.nn.utils import clip_grad_norm_
        import modelparallel as mp
        from modelparallel.models import GPT, GPTConfig
        from modelparallel.models.gpt import lm_loss

        mp.init({"tensor_parallel_degree": 2})
        model = mp.transform(GPT(GPTConfig(vocab_size=64, max_seq_len=8, d_model=32,
                                           n_layers=1, n_heads=4)))
        x = torch.randint(64, (2, 8))
        lm_loss(model(x), x).backward()
        clip_grad_norm_(model.parameters(), 1.0)
    """)
    ran = modelparallel("run", "--nproc-per-node", 2, path, timeout=300)
    assert ran.code == 1, ran.all
    line = ("error: RuntimeError: torch.nn.utils.clip_grad_norm_ cannot add up this model's "
            "gradient norms (its parameters are DTensors on several meshes, or DTensors and "
            "plain tensors): call mp.clip_grad_norm_(model, max_norm)")
    assert ran.err.count(line) == 1, ran.err
    assert f"in your code: {path}:13: clip_grad_norm_(" in ran.err, ran.err
