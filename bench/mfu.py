"""Benchmark: one GPU's model FLOPs utilisation of a ~1.3 B-parameter GPT in bf16 through
the library, against the same model trained in plain PyTorch; and the planner's peak
memory against the CUDA allocator's.

    python bench/mfu.py [--layers 24] [--width 2048] [--seq-len 2048] [--batch-size 4]
                        [--steps 8] [--peak-tflops 989]

Needs one CUDA GPU. Both sides train the reference GPT (``models/gpt.py``: SDPA
attention, untied embeddings) with AdamW (torch's default implementation) and cross
entropy on random tokens, float32 parameters and bfloat16 compute:

- library: ``mp.init({"bf16": True})``, ``mp.transform`` + ``mp.shard`` (one rank): the
  planner's ``TrainingScript(api="v2")`` itself, so its plan is of this very step;
- plain: the model on the GPU under ``torch.autocast(dtype=torch.bfloat16)``, the same
  loss (cross entropy of float32 logits) and optimizer.

FLOPs per step are counted once by ``torch.utils.flop_counter.FlopCounterMode`` on the
plain step (matrix multiplies and attention as torch counts them; attention is counted
whole, causal masking not subtracted). MFU = FLOPs per step / step time / the GPU's
dense bf16 peak (``--peak-tflops``, 989 for H100/H200 SXM: a datasheet figure, not a
measurement). Step times are medians of ``--steps`` steps after two warm-up steps,
the two sides alternating in blocks. Prints, as its last line, ratios measured in this
run: ``mfu_library``, ``mfu_plain``, ``library_over_plain_step`` (the wrapper's cost,
goal <= 1.02), and ``planned_over_measured_peak`` when ``--planned-peak`` gives the
planner's prediction for the library side (``modelparallel plan --api v2 ...``, run
anywhere) to compare with ``torch.cuda.max_memory_allocated``.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch.utils.flop_counter import FlopCounterMode

import modelparallel as mp
from modelparallel.models.gpt import GPT, GPTConfig
from modelparallel.plan.workload import TrainingScript, Workload, lm_loss


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--vocab", type=int, default=50304)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--peak-tflops", type=float, default=989.0)
    p.add_argument("--planned-peak", type=int, default=None, metavar="BYTES")
    a = p.parse_args()
    assert torch.cuda.is_available(), "bench/mfu.py needs a CUDA GPU"
    cfg = GPTConfig(vocab_size=a.vocab, d_model=a.width, n_layers=a.layers, n_heads=a.heads,
                    max_seq_len=a.seq_len)
    device = torch.device("cuda", 0)
    x = torch.randint(0, a.vocab, (a.batch_size, a.seq_len), device=device)
    y = torch.randint(0, a.vocab, (a.batch_size, a.seq_len), device=device)

    torch.manual_seed(0)
    with device:  # built on the GPU: a 1.3 B model initialised on the CPU takes a while
        plain = GPT(cfg)
    params = sum(q.numel() for q in plain.parameters())
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-4)

    def plain_step() -> None:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = lm_loss(plain(x), y)
        loss.backward()
        plain_opt.step()
        plain_opt.zero_grad()

    with FlopCounterMode(display=False) as counter:
        plain_step()
    flops = counter.get_total_flops()

    mp.init({"bf16": True})
    torch.manual_seed(0)
    with device:
        script = TrainingScript(Workload(lambda: GPT(cfg), {"bf16": True}, 1, a.batch_size,
                                         a.seq_len, api="v2"), mp)
    library_step = script.step

    for step in (plain_step, library_step):  # warm-up: kernels chosen, optimizer state made
        step()
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats(device)
    times: dict[str, list[float]] = {"plain": [], "library": []}
    for _ in range(a.steps):
        for name, step in (("plain", plain_step), ("library", library_step)):
            torch.cuda.synchronize()
            start = time.perf_counter()
            step()
            torch.cuda.synchronize()
            times[name].append(time.perf_counter() - start)
    median = {k: statistics.median(v) for k, v in times.items()}
    peak_flops = a.peak_tflops * 1e12
    mfu = {k: flops / t / peak_flops for k, t in median.items()}
    print(f"GPT {params / 1e9:.2f} B parameters, batch {a.batch_size} x {a.seq_len}, bf16 "
          f"compute, AdamW, on {torch.cuda.get_device_name(device)}")
    print(f"FLOPs per step (counted): {flops / 1e12:.1f} T; step: plain "
          f"{median['plain'] * 1e3:.1f} ms, library {median['library'] * 1e3:.1f} ms "
          f"(median of {a.steps})")
    both = torch.cuda.max_memory_allocated(device)
    print(f"peak allocated with both models alive: {both / 2**30:.2f} GiB")
    ratios = {"mfu_library": mfu["library"], "mfu_plain": mfu["plain"],
              "library_over_plain_step": median["library"] / median["plain"]}
    if a.planned_peak:
        del plain, plain_opt, x, y
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        library_step()
        torch.cuda.synchronize()
        measured = torch.cuda.max_memory_allocated(device)
        print(f"library step alone: peak allocated {measured / 2**30:.3f} GiB, planned "
              f"{a.planned_peak / 2**30:.3f} GiB")
        ratios["planned_over_measured_peak"] = a.planned_peak / measured
    print("RATIOS " + " ".join(f"{k}={v:.4f}" for k, v in ratios.items()))


if __name__ == "__main__":
    main()
