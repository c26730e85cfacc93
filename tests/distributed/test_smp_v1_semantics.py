"""SMP v1 behaviours a script relies on: sharded data parallelism clips gradients at
``sdp_gradient_clipping``; ``tensor_parallel_seed`` and ``random_seed`` decide which
dropout masks agree across tensor-parallel ranks; replicas start from data-parallel
rank 0's weights whatever each rank seeded."""

import pytest
import torch
import torch.nn.functional as F

import modelparallel as mp
from modelparallel.models import GPT, GPTConfig
from modelparallel.models.gpt import lm_loss
from modelparallel.testing import token_batches

CFG = GPTConfig(vocab_size=64, max_seq_len=8, d_model=32, n_layers=2, n_heads=8)
BATCHES = token_batches(3, 8, 8, 64, seed=1)


def _gpt(seed: int = 0, tied: bool = False) -> GPT:
    torch.manual_seed(seed)
    return GPT(GPTConfig(**{**CFG.__dict__, "tie_embeddings": tied}))


def _reference(clip: float | None, tied: bool = False) -> dict[str, torch.Tensor]:
    model = _gpt(tied=tied)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    for x, y in BATCHES:
        opt.zero_grad()
        lm_loss(model(x), y).backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def sdp_case(clip: float, pp: int) -> dict[str, torch.Tensor]:
    mp.init({"sharded_data_parallel_degree": 2, "ddp": True, "sdp_gradient_clipping": clip,
             "pipeline_parallel_degree": pp, "microbatches": pp})
    # rank 0's weights everywhere; with a pipeline the tied embedding is on both stages
    model = mp.DistributedModel(_gpt(seed=mp.dp_rank(), tied=pp > 1))
    opt = mp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.5))

    @mp.step
    def step(model, x, y):
        loss = lm_loss(model(x), y)
        model.backward(loss)
        return loss

    rows = 8 // mp.dp_size()
    for x, y in BATCHES:
        opt.zero_grad()
        r = slice(mp.dp_rank() * rows, (mp.dp_rank() + 1) * rows)
        step(model, x[r], y[r])
        opt.step()
    return model.state_dict()


@pytest.mark.parametrize("pp", [1, 2])
def test_sharded_data_parallelism_clips_at_sdp_gradient_clipping(workers, pp):
    """The global norm: over FSDP shards and, with a pipeline, over the stages (the tied
    embedding both stages hold counted once)."""
    clipped, unclipped = _reference(0.05, tied=pp > 1), _reference(None, tied=pp > 1)
    assert max((clipped[k] - unclipped[k]).abs().max() for k in clipped) > 1e-3  # it matters
    for params in workers(2 * pp).run(sdp_case, clip=0.05, pp=pp):
        for name, want in clipped.items():
            torch.testing.assert_close(params[name], want, rtol=1e-5, atol=1e-7)


def dropout_case(tensor_parallel_seed: int, random_seed: int) -> dict[str, torch.Tensor]:
    """Masks drawn in three regions of HF GPT-2 under tp 2: the attention's replicated
    output (REPLICATED: tensor_parallel_seed), inside the attention (SHARDED: random_seed
    + tp rank), and the MLP's dropout (the global generator, made equal over the group)."""
    import transformers as T

    mp.init({"tensor_parallel_degree": 2, "prescaled_batch": True,
             "tensor_parallel_seed": tensor_parallel_seed, "random_seed": random_seed})
    torch.manual_seed(100 + mp.rank())  # scripts often seed each rank apart
    model = mp.transform(T.GPT2LMHeadModel(T.GPT2Config(
        vocab_size=64, n_embd=32, n_layer=1, n_head=8, n_positions=16, resid_pdrop=0.5,
        embd_pdrop=0.0, attn_pdrop=0.5, attn_implementation="eager")))
    model.train()
    masks = {}
    block = model.transformer.h[0]

    def zeros(name):
        def hook(module, args, out) -> None:
            masks.setdefault(name, (out == 0).clone())
        return hook

    block.attn.resid_dropout.register_forward_hook(zeros("replicated"))
    # random numbers drawn inside the attention (its dropout is functional in HF 5)
    def draw(module, args) -> None:
        masks.setdefault("sharded", torch.rand(16) < 0.5)

    block.attn.c_proj.register_forward_pre_hook(draw)
    block.mlp.dropout.register_forward_hook(zeros("global"))
    model(torch.randint(64, (2, 8), generator=torch.Generator().manual_seed(0)))
    return masks


def test_dropout_masks_follow_smp_seeds(workers):
    r0, r1 = workers(2).run(dropout_case, tensor_parallel_seed=0, random_seed=7)
    assert torch.equal(r0["replicated"], r1["replicated"])  # same on every TP rank
    assert not torch.equal(r0["sharded"], r1["sharded"])    # each rank its own heads
    assert torch.equal(r0["global"], r1["global"])          # despite seeding apart
    assert 0 < r0["replicated"].float().mean() < 1
    other, _ = workers(2).run(dropout_case, tensor_parallel_seed=5, random_seed=7)
    assert not torch.equal(other["replicated"], r0["replicated"])  # the key picks them
    assert torch.equal(other["sharded"], r0["sharded"])
    third, _ = workers(2).run(dropout_case, tensor_parallel_seed=0, random_seed=8)
    assert not torch.equal(third["sharded"], r0["sharded"])
    assert torch.equal(third["replicated"], r0["replicated"])


def ddp_sync_case() -> list[torch.Tensor]:
    mp.init({"ddp": True, "hybrid_shard_degree": 1})
    model = mp.DistributedModel(_gpt(seed=mp.rank()))

    @mp.step
    def step(model, x):
        loss = F.cross_entropy(model(x).flatten(0, 1), x.flatten())
        model.backward(loss)
        return loss

    step(model, torch.randint(64, (2, 8)))
    return [p.detach().clone() for p in model.local_parameters()]


def test_replicas_start_from_data_parallel_rank_0(workers):
    results = workers(4).run(ddp_sync_case)
    reference = [p.detach() for p in _gpt(seed=0).parameters()]
    for params in results:
        for got, want in zip(params, reference, strict=True):
            assert torch.equal(got, want)


def notes_case(config: dict, call: str) -> list[str]:
    import logging

    messages: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: messages.append(record.getMessage())
    logging.getLogger("modelparallel").addHandler(handler)
    try:
        mp.init(config)
        try:
            (mp.shard if call == "shard" else mp.replicate)(_gpt())
        except mp.ConfigError as e:
            messages.append(f"ConfigError: {e}")
    finally:
        logging.getLogger("modelparallel").removeHandler(handler)
    return messages


def test_keys_of_other_paths_say_they_do_nothing_or_are_refused(workers):
    rank0, rank1 = workers(2).run(notes_case, call="shard", config={
        "ddp": True, "sharded_data_parallel_degree": 2, "microbatches": 2})
    assert any(m.startswith("ddp=True has no effect on mp.shard()") for m in rank0)
    assert any(m.startswith("sdp_gradient_clipping is applied by mp.DistributedOptimizer; "
                            "with mp.shard() clip yourself") for m in rank0)
    assert any(m.startswith("microbatches=2 has no effect on mp.shard()") for m in rank0)
    assert rank1 == []  # said once
    rank0, _ = workers(2).run(notes_case, call="replicate", config={"microbatches": 2})
    assert any(m.startswith("microbatches=2 has no effect on mp.replicate()") for m in rank0)
    for config, key in (({"hybrid_shard_degree": 2}, "hybrid_shard_degree"),
                        ({"sharded_data_parallel_degree": 2}, "sharded_data_parallel_degree")):
        for messages in workers(2).run(notes_case, call="replicate", config=config):
            assert any(m.startswith("ConfigError") and f"- {key}: " in m
                       and "mp.replicate() replicates; use mp.shard()" in m
                       for m in messages), messages
