"""Full checkpoints load in Hugging Face; the data loader's position and the DCP-style
calls (save/load/async_save) round-trip."""

import os

import torch
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.utils.data import TensorDataset

import modelparallel as mp


def tiny_gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=64,
                                      n_positions=32))


def hf_full_case(root: str) -> dict:
    mp.init({"hybrid_shard_degree": 0, "tensor_parallel_degree": 2})
    model = mp.shard(mp.transform(tiny_gpt2()))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randint(64, (2, 16))
    model(x, labels=x).loss.backward()
    optimizer.step()
    mp.save_checkpoint(root, "final", partial=False, model=model, optimizer=optimizer)
    return mp.full_state_dict(model)  # rank 0: every tensor, whole


def test_full_checkpoint_of_a_sharded_tensor_parallel_model_loads_with_from_pretrained(
        workers, tmp_path):
    from transformers import GPT2LMHeadModel

    root = tmp_path / "ckpt"
    trained = workers(4).run(hf_full_case, root=str(root))[0]
    files = sorted(os.listdir(root / "final"))
    assert {"model.safetensors", "config.json", "optimizer.safetensors",
            "checkpoint.json"} <= set(files)
    loaded = GPT2LMHeadModel.from_pretrained(root / "final").state_dict()
    assert set(trained) <= set(loaded)
    for name, tensor in trained.items():
        assert torch.equal(loaded[name], tensor), name


def loader_case(root: str) -> tuple[list, list]:
    mp.init({"hybrid_shard_degree": 0})
    data = TensorDataset(torch.arange(40))
    loader = mp.data.DataLoader(data, batch_size=4, seed=3)
    loader.set_epoch(1)
    batches = iter(loader)
    for _ in range(3):
        next(batches)
    mp.save_checkpoint(root, "mid", data_loader=loader)
    expected = [b[0].tolist() for b in batches]  # the rest of epoch 1
    loader.set_epoch(2)
    epoch2 = [b[0].tolist() for b in loader]  # a whole pass: the position resets
    expected.append(epoch2[0])  # and the next epoch's first

    fresh = mp.data.DataLoader(data, batch_size=4, seed=3)
    mp.resume_from_checkpoint(root, data_loader=fresh)
    got = [b[0].tolist() for b in fresh]
    fresh.set_epoch(2)
    epoch2 = [b[0].tolist() for b in fresh]
    got.append(epoch2[0])
    return got, expected


def test_data_loader_resumes_mid_epoch(workers, tmp_path):
    for got, expected in workers(2).run(loader_case, root=str(tmp_path / "ckpt")):
        assert len(got) == 2 + 1  # 5 batches per replica per epoch, 3 taken
        assert got == expected


def dcp_style_case(root: str) -> list[bool]:
    mp.init({"hybrid_shard_degree": 2})
    torch.manual_seed(0)
    model = mp.shard(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(4, 4)).sum().backward()
    optimizer.step()

    def full():
        m, _ = get_state_dict(model, optimizer)
        return {k: v.full_tensor().clone() if hasattr(v, "full_tensor") else v
                for k, v in m.items()}

    ok = []
    for how in ("save", "async_save"):
        expected = full()
        model_sd, optim_sd = get_state_dict(model, optimizer)
        sd = {"model": model_sd, "optimizer": optim_sd, "extra": {"epoch": 3}}
        path = os.path.join(root, how)
        if how == "save":
            mp.checkpoint.save(sd, checkpoint_id=path)
        else:
            mp.checkpoint.async_save(sd, checkpoint_id=path).result()
        with torch.no_grad():
            for p in model.parameters():
                p.zero_()
        model_sd, optim_sd = get_state_dict(model, optimizer)
        target = {"model": model_sd, "optimizer": optim_sd, "extra": {"epoch": 0}}
        mp.checkpoint.load(target, checkpoint_id=path)
        set_state_dict(model, optimizer, model_state_dict=target["model"],
                       optim_state_dict=target["optimizer"])
        now = full()
        ok.append(target["extra"] == {"epoch": 3} and all(
            torch.equal(now[k], v) for k, v in expected.items()))
        names = os.listdir(root)  # committed under its name, nothing temporary left
        ok.append(how in names and not any(n.startswith(".") for n in names))
    return ok


def test_dcp_style_save_load_and_async_save(workers, tmp_path):
    for ok in workers(4).run(dcp_style_case, root=str(tmp_path)):
        assert ok == [True, True, True, True]


def fsdp1_case(root: str) -> list[bool]:
    """An unchanged FSDP1 script (SMP v2 style) saves and resumes sharded and full
    checkpoints: after each resume the next steps are those after the save."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    mp.init({"hybrid_shard_degree": 2})
    torch.manual_seed(0)
    model = FSDP(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2)),
                 use_orig_params=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    def step() -> float:
        torch.manual_seed(1)
        loss = model(torch.randn(4, 4)).pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss.item()

    step()
    same = []
    for tag, partial in (("sharded", True), ("full", False)):
        mp.save_checkpoint(root, tag, partial=partial, model=model, optimizer=optimizer)
        expected = [step(), step()]
        mp.resume_from_checkpoint(root, tag, model=model, optimizer=optimizer)
        same.append([step(), step()] == expected)
    return same


def test_fsdp1_script_round_trips(workers, tmp_path):
    for same in workers(4).run(fsdp1_case, root=str(tmp_path / "ckpt")):
        assert same == [True, True]
