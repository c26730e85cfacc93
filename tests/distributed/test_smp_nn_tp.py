"""smp.nn's LM head split over 2 tensor-parallel ranks trains like one process: SMP v1's
script (DistributedModel, @step, DistributedOptimizer) with DistributedTransformerLMHead,
and SMP v2's (tsm.transform, a torch optimizer) with TransformerLMHead. Losses at every
step and every parameter at the end."""

import torch

import modelparallel as mp
from modelparallel.smp.nn import DistributedTransformerLMHead
from modelparallel.smp.v2.nn.tensor_parallel_transformer import TransformerLMHead
from modelparallel.testing import TrainResult, assert_parity, full_parameters

STEPS, ROWS, SEQ, VOCAB = 3, 8, 12, 64
ARGS = dict(num_layers=2, num_attention_heads=4, attention_head_size=8, hidden_size=32,
            intermediate_size=64, vocab_size=VOCAB, num_positions=16,
            attention_dropout_prob=0.0, hidden_dropout_prob=0.0, num_token_types=2,
            use_normal_initialization=True, initializer_range=0.05)
V1_ARGS = dict(ARGS, causal_mask_size=16, pre_layernorm=True, post_layernorm=True)


def batches():
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(STEPS):
        ids = torch.randint(VOCAB, (ROWS, SEQ), generator=g)
        mask = torch.ones(ROWS, SEQ)
        mask[1, 8:] = mask[6, 10:] = 0  # right padding, on both ranks' rows
        out.append((ids, mask, torch.randint(2, (ROWS, SEQ), generator=g)))
    return out


def sgd(params):
    return torch.optim.SGD(params, lr=0.5, momentum=0.9)


def v1_loss(model, ids, mask, types):
    return model((ids, mask, types, None, ids))[0]  # (loss, logits) with labels


def v2_loss(model, ids, mask, types):
    return model(input_ids=ids, attention_mask=mask, labels=ids, token_type_ids=types)["loss"]


def reference(v2: bool) -> TrainResult:
    torch.manual_seed(0)
    model = TransformerLMHead(**ARGS) if v2 else DistributedTransformerLMHead(**V1_ARGS)
    opt, losses = sgd(model.parameters()), []
    for ids, mask, types in batches():
        opt.zero_grad()
        loss = (v2_loss if v2 else v1_loss)(model, ids, mask, types)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return TrainResult(losses, {k: v.detach().clone() for k, v in model.state_dict().items()})


def v1_case(prescaled: bool) -> TrainResult:
    mp.init({"tensor_parallel_degree": 2, "prescaled_batch": prescaled})
    torch.manual_seed(0)
    model = mp.DistributedModel(DistributedTransformerLMHead(**V1_ARGS))
    opt = mp.DistributedOptimizer(sgd(model.parameters()))

    @mp.step
    def step(model, ids, mask, types):
        loss = v1_loss(model, ids, mask, types)
        model.backward(loss)
        return loss

    # each rank its own rows (dp_rank), or the TP group the same rows (rdp_rank)
    index, count = (mp.rdp_rank(), mp.rdp_size()) if prescaled else (mp.dp_rank(), mp.dp_size())
    rows = slice(index * ROWS // count, (index + 1) * ROWS // count)
    losses = []
    for ids, mask, types in batches():
        opt.zero_grad()
        losses.append(float(step(model, ids[rows], mask[rows], types[rows]).reduce_mean()))
        opt.step()
    split = sum(isinstance(p, torch.distributed.tensor.DTensor) for p in model.parameters())
    assert split >= 2 * 6 + 1, split  # q, k, v, dense, dense1, dense2 (+biases), vocabulary
    return TrainResult(losses, model.state_dict())


def v2_case(loss_parallel: bool) -> TrainResult:
    mp.init({"tensor_parallel_degree": 2, "prescaled_batch": True})
    torch.manual_seed(0)
    model = mp.transform(TransformerLMHead(**ARGS), loss_parallel=loss_parallel)
    assert model.lm_head.weight is model.word_embedding.weight  # tied after the split
    opt, losses = sgd(model.parameters()), []
    for ids, mask, types in batches():
        opt.zero_grad()
        with mp.loss_parallel():  # the model's own loss on vocabulary-sharded logits
            loss = v2_loss(model, ids, mask, types)
            loss.backward()
        opt.step()
        losses.append(float((loss.full_tensor() if loss_parallel else loss).detach()))
    return TrainResult(losses, full_parameters(model))


def test_distributed_transformer_lm_head_tp2_matches_one_process(workers):
    want = reference(v2=False)
    for prescaled in (False, True):
        for result in workers(2).run(v1_case, prescaled=prescaled):
            assert_parity(result, want)


def test_transformer_lm_head_tp2_matches_one_process(workers):
    want = reference(v2=True)
    for loss_parallel in (False, True):
        for result in workers(2).run(v2_case, loss_parallel=loss_parallel):
            assert_parity(result, want)
