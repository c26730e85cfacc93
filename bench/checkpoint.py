"""Benchmark: checkpoint save/load, sharded vs full, ours vs plain DCP, async stall.

    python bench/checkpoint.py [--world-size 4] [--layers 3] [--reps 5] [--steps 8] [--every 2]

Runs in real gloo processes on this machine, FSDP over every rank (``mp.init`` with
``hybrid_shard_degree`` = world size, ``mp.shard``), on a GPT of d_model 1024 (about
50 MB of fp32 parameters per layer: 150 MB for 3 layers) trained with SGD + momentum
(its state as large again: 300 MB in all), after one step so the optimizer state
exists. Checkpoints go to a temporary
directory under /tmp, removed at the end. Prints, as its last line, ratios measured in
this one run:

- ckpt_save_full_over_sharded, ckpt_load_full_over_sharded: median time of
  ``mp.save_checkpoint`` / ``mp.resume_from_checkpoint`` (model + optimizer) with
  ``partial=False`` (rank 0 gathers everything and writes safetensors) over
  ``partial=True`` (each rank writes its shards with DCP);
- ckpt_save_ours_over_dcp: our sharded save over plain ``torch.distributed.checkpoint.save``
  of the same state dicts (``get_model_state_dict`` / ``get_optimizer_state_dict``,
  flattened, taken inside the timed call for both) to the same disk: our overhead (the
  every-rank guard, random generator and small state files, manifest, atomic rename);
- async_stall_over_blocking: the time a training loop spends in its checkpoint calls
  (one every ``--every`` steps) with ``mp.checkpoint.async_save`` (the staging copy,
  plus waiting for the previous save to be committed before starting the next) over
  the same with the blocking ``mp.checkpoint.save`` (goal <= 0.10). The wait for the last
  async save after the loop (once per training run) is shown apart, and so is each
  loop's time over the same loop without checkpoints, which also counts the
  background writer's competition for the CPU (noisy: the steps are most of it).
  The last checkpoint of each loop is loaded back and checked against the state at
  its save call;
- ckpt_save_over_disk_write: the sharded save's bandwidth (checkpoint bytes over its
  median time, everything in ``mp.save_checkpoint`` counted) over the disk's fsync
  write bandwidth for the same bytes, measured in the same repetitions: every rank at
  once writes its share to its own file in 1 MiB writes from Python and fsyncs it (what
  ``dd bs=1M conv=fsync`` does: the disk starts writing at the fsync; our writer starts
  the writeback while it writes, so this can exceed 1; goal >= 0.80);
- ckpt_load_over_disk_read: the sharded load from the disk (its files evicted from the
  page cache first with ``posix_fadvise(DONTNEED)``) over reading the same number of
  bytes from the disk (the reference files, evicted alike) in 1 MiB reads (goal
  >= 0.80); a load from
  the page cache over a read from it is printed too (not a goal: a read from memory is
  one copy, a load also plans, decodes and sets the state);
- async_stall_with_final_wait_over_blocking: as async_stall_over_blocking, plus the
  wait for the last async save after the loop.

Every measurement starts and ends at a barrier; the variants alternate so machine
noise hits them alike. The "sharded" and "full" loads read files that were just
written, mostly from the page cache.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as torch_dcp
from paired_timing import lm_batch, lm_step
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

import modelparallel as mp
from modelparallel.models import GPT, GPTConfig
from modelparallel.testing import WorkerGroup

BATCH, SEQ = 1, 32  # sequences per rank and step, tokens per sequence
LR = 1e-3
SAVE_VARIANTS = ("sharded", "full", "dcp")  # ours partial=True, ours partial=False, plain DCP
LOAD_VARIANTS = ("sharded", "full", "cold")  # cold: sharded, its files evicted from the cache
DISK = ("write", "read", "cached read")  # the same bytes written with fsync, then read back
OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)  # what our sharded save takes


def _config(layers: int) -> dict:
    return {"vocab_size": 256, "max_seq_len": 64, "d_model": 1024, "n_layers": layers,
            "n_heads": 16}


def _setup(layers: int):
    """FSDP over every rank, the GPT, SGD with momentum, one step taken; the batch."""
    mp.init({"hybrid_shard_degree": dist.get_world_size()})
    torch.manual_seed(0)
    cfg = _config(layers)
    model = mp.shard(GPT(GPTConfig(**cfg)))
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    batch = lm_batch(cfg["vocab_size"], SEQ, BATCH)
    lm_step(model, opt, *batch)  # the momentum buffers exist from here
    return model, opt, batch


def _state_dict(model, opt) -> dict:
    return {"model": get_model_state_dict(model, options=OPTIONS),
            "optimizer": get_optimizer_state_dict(model, opt, options=OPTIONS)}


def _tensors(model, opt) -> list[torch.Tensor]:
    """This rank's shards of the parameters and of the momentum buffers."""
    params = list(model.parameters())
    return [t.to_local() if hasattr(t, "to_local") else t
            for t in params + [opt.state[p]["momentum_buffer"] for p in params]]


def _checksum(model, opt) -> float:
    return sum(float(t.detach().double().sum()) for t in _tensors(model, opt))


def _scramble(model, opt) -> None:
    """Overwrite what a load must restore, so a load that restores nothing shows."""
    with torch.no_grad():
        for t in _tensors(model, opt):
            t.fill_(0.5)


def _bytes_under(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path)
               for f in files)


def _timed(fn) -> float:
    dist.barrier()
    start = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - start


def _flush() -> None:
    """Write out dirty pages (untimed), so one variant's writeback does not slow the next:
    DCP fsyncs its files, the full checkpoint's safetensors files are not fsynced."""
    dist.barrier()
    if dist.get_rank() == 0:
        os.sync()
    dist.barrier()


def _evict(path: str) -> None:
    """Drop the (clean: written with fsync, or after _flush) pages of the files under
    ``path`` from the page cache, so the next read comes from the disk."""
    dist.barrier()
    if dist.get_rank() == 0:
        for name in (os.path.join(d, f) for d, _, files in os.walk(path) for f in files):
            fd = os.open(name, os.O_RDONLY)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)
    dist.barrier()


def _disk(kind: str, path: str, nbytes: int) -> float:
    """The disk without the checkpoint code: every rank at once writes its share of
    ``nbytes`` to its own file in 1 MiB writes and fsyncs it (as ``dd bs=1M conv=fsync``),
    or reads its file back in 1 MiB reads (as ``dd bs=1M of=/dev/null``); timed like a
    save, from barrier to barrier."""
    name = os.path.join(path, f"disk-{dist.get_rank()}")
    share = nbytes // dist.get_world_size()
    block = bytearray(1 << 20)

    def write() -> None:
        with open(name, "wb", buffering=0) as f:
            for start in range(0, share, len(block)):
                f.write(memoryview(block)[:min(len(block), share - start)])
            os.fsync(f.fileno())

    def read() -> None:
        with open(name, "rb", buffering=0) as f:
            while f.readinto(block):
                pass

    os.makedirs(path, exist_ok=True)
    return _timed(write if kind == "write" else read)


def _remove(path: str) -> None:
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(path, ignore_errors=True)
    dist.barrier()


def save_load_case(layers: int, reps: int, root: str) -> dict | None:
    """Save and load times (and sizes) of our sharded and full checkpoints and of plain
    DCP, ``reps`` times each after one untimed round (first calls: imports, thread
    pools), the order rotating from one repetition to the next."""
    model, opt, _ = _setup(layers)
    state_bytes = sum(t.numel() * t.element_size() for t in _tensors(model, opt))
    state_bytes *= dist.get_world_size()  # every rank holds an equal share (FSDP)
    expected = _checksum(model, opt)
    saves: dict[str, list[float]] = {v: [] for v in SAVE_VARIANTS}
    loads: dict[str, list[float]] = {v: [] for v in LOAD_VARIANTS}
    disk: dict[str, list[float]] = {v: [] for v in DISK}
    sizes: dict[str, int] = {}
    path = os.path.join(root, "save_load")
    for rep in range(reps + 1):  # rep 0 warms up
        k = rep % len(SAVE_VARIANTS)
        for variant in SAVE_VARIANTS[k:] + SAVE_VARIANTS[:k]:
            tag = f"{variant}-{rep}"
            if variant == "dcp":
                def save(tag=tag):
                    torch_dcp.save(_state_dict(model, opt), checkpoint_id=os.path.join(path, tag))
            else:
                def save(tag=tag, variant=variant):
                    mp.save_checkpoint(path, tag, partial=variant == "sharded", model=model,
                                       optimizer=opt)
            took = _timed(save)
            if rep:
                saves[variant].append(took)
            if dist.get_rank() == 0:
                sizes[variant] = _bytes_under(os.path.join(path, tag))
            _flush()
        disk_bytes = _bytes_under(os.path.join(path, f"sharded-{rep}"))  # on every rank
        took = _disk("write", os.path.join(path, "disk"), disk_bytes)
        _evict(os.path.join(path, "disk"))
        took_read = _disk("read", os.path.join(path, "disk"), disk_bytes)
        if rep:
            disk["write"].append(took)
            disk["read"].append(took_read)
            disk["cached read"].append(_disk("read", os.path.join(path, "disk"), disk_bytes))
            sizes["disk"] = disk_bytes // dist.get_world_size() * dist.get_world_size()
        k = rep % len(LOAD_VARIANTS)
        for variant in LOAD_VARIANTS[k:] + LOAD_VARIANTS[:k]:
            _scramble(model, opt)
            tag = f"{'sharded' if variant == 'cold' else variant}-{rep}"
            if variant == "cold":
                _evict(os.path.join(path, tag))

            def load(tag=tag):
                mp.resume_from_checkpoint(path, tag, model=model, optimizer=opt)

            took = _timed(load)
            if rep:
                loads[variant].append(took)
            got = _checksum(model, opt)
            if abs(got - expected) > 1e-6 * max(1.0, abs(expected)):
                raise RuntimeError(f"{variant} checkpoint loaded wrong values on rank "
                                   f"{dist.get_rank()}: checksum {got!r}, saved {expected!r}")
        _remove(path)
    if dist.get_rank() != 0:
        return None
    params = sum(p.numel() for p in model.parameters())
    return {"saves": saves, "loads": loads, "disk": disk, "sizes": sizes,
            "state_bytes": state_bytes, "params": params}


def _loop(model, opt, batch, steps: int, every: int, kind: str, root: str) -> dict:
    """``steps`` training steps with a checkpoint every ``every`` steps (``kind``: none,
    blocking or async); the loop's time and the time spent in checkpoint calls."""
    calls: list[float] = []
    pending = None
    checked = 0.0  # time of the checksum below, not counted in the loop
    _flush()
    start = time.perf_counter()
    for i in range(steps):
        lm_step(model, opt, *batch)
        if kind == "none" or (i + 1) % every:
            continue
        checkpoint_id = os.path.join(root, f"{kind}-step{i + 1}")
        t = time.perf_counter()
        saved_sum = _checksum(model, opt)  # of the state this save must write
        checked += time.perf_counter() - t
        t = time.perf_counter()
        if kind == "blocking":
            mp.checkpoint.save(_state_dict(model, opt), checkpoint_id=checkpoint_id)
        else:
            if pending is not None:
                pending.result()  # one save at a time: the previous one must be committed
            pending = mp.checkpoint.async_save(_state_dict(model, opt),
                                               checkpoint_id=checkpoint_id)
        calls.append(time.perf_counter() - t)
    final_wait = 0.0
    if pending is not None:
        t = time.perf_counter()
        pending.result()
        final_wait = time.perf_counter() - t
    dist.barrier()
    total = time.perf_counter() - start - checked
    if kind != "none":
        saved = sorted(n for n in os.listdir(root) if n.startswith(f"{kind}-step"))
        if len(saved) != steps // every:
            raise RuntimeError(f"{kind}: {len(saved)} checkpoints committed, expected "
                               f"{steps // every}: {saved}")
        _check_last(model, opt, checkpoint_id, saved_sum)
    _remove(root)
    return {"total": total, "calls": calls, "final_wait": final_wait, "stall": sum(calls)}


def _check_last(model, opt, checkpoint_id: str, saved_sum: float) -> None:
    """Load the last checkpoint back: it must hold the state at its save call (an async
    save must not have written what training changed after its call returned)."""
    sd = _state_dict(model, opt)
    _scramble(model, opt)
    mp.checkpoint.load(sd, checkpoint_id=checkpoint_id)
    set_model_state_dict(model, sd["model"], options=OPTIONS)
    set_optimizer_state_dict(model, opt, sd["optimizer"], options=OPTIONS)
    got = _checksum(model, opt)
    if abs(got - saved_sum) > 1e-6 * max(1.0, abs(saved_sum)):
        raise RuntimeError(f"{checkpoint_id} holds other values than at its save call on "
                           f"rank {dist.get_rank()}: checksum {got!r}, expected {saved_sum!r}")


def stall_case(layers: int, steps: int, every: int, rounds: int, root: str) -> dict | None:
    """The three loops (no checkpoint, blocking, async), ``rounds`` times, the order
    reversed every other round, after one untimed save of each kind (the first async
    save also creates its background gloo group)."""
    model, opt, batch = _setup(layers)
    lm_step(model, opt, *batch)
    warm = os.path.join(root, "warm-up")
    mp.checkpoint.save(_state_dict(model, opt), checkpoint_id=os.path.join(warm, "blocking"))
    mp.checkpoint.async_save(_state_dict(model, opt),
                             checkpoint_id=os.path.join(warm, "async")).result()
    _remove(warm)
    kinds = ("none", "blocking", "async")
    results: dict[str, list[dict]] = {k: [] for k in kinds}
    for r in range(rounds):
        for kind in kinds if r % 2 == 0 else kinds[::-1]:
            os.makedirs(os.path.join(root, "stall"), exist_ok=True)
            results[kind].append(_loop(model, opt, batch, steps, every, kind,
                                       os.path.join(root, "stall")))
    return results if dist.get_rank() == 0 else None


def _mb(n: float) -> str:
    return f"{n / 1e6:.0f} MB"


def _runs(times: list[float]) -> str:
    return ", ".join(f"{t:.2f}" for t in times)


def _report_save_load(got: dict, reps: int, n: int) -> dict[str, float]:
    """Print the save, load and disk times; their ratios."""
    med = {k: statistics.median(v) for k, v in got["saves"].items()}
    lmed = {k: statistics.median(v) for k, v in got["loads"].items()}
    dmed = {k: statistics.median(v) for k, v in got["disk"].items()}
    sizes = got["sizes"]
    sizes["cold"] = sizes["sharded"]
    print(f"save, median of {reps} (model + optimizer, every rank waits at a barrier after):")
    names = {"sharded": "ours partial=True (DCP shards)",
             "full": "ours partial=False (rank 0 safetensors)",
             "dcp": "plain torch DCP save",
             "cold": "ours partial=True, files not in page cache"}
    for v in SAVE_VARIANTS:
        print(f"   {names[v]:42} {med[v]:6.2f} s  {_mb(sizes[v]):>7} written  "
              f"{sizes[v] / 1e6 / med[v]:6.0f} MB/s  (runs {_runs(got['saves'][v])} s)")
    print(f"load, median of {reps} (into the sharded model and optimizer, checked):")
    for v in LOAD_VARIANTS:
        print(f"   {names[v]:42} {lmed[v]:6.2f} s  {_mb(sizes[v]):>7} read     "
              f"{sizes[v] / 1e6 / lmed[v]:6.0f} MB/s  (runs {_runs(got['loads'][v])} s)")
    nbytes = sizes["disk"]
    print(f"disk, median of {reps} (no checkpoint code: the {n} ranks at once, each its "
          f"share in its own file, 1 MiB blocks):")
    what = {"write": "written, then fsync", "read": "read, not in page cache",
            "cached read": "read again, from page cache"}
    for v in DISK:
        print(f"   {what[v]:42} {dmed[v]:6.2f} s  {_mb(nbytes):>7}          "
              f"{nbytes / 1e6 / dmed[v]:6.0f} MB/s  (runs {_runs(got['disk'][v])} s)")
    ratios = {"ckpt_save_full_over_sharded": med["full"] / med["sharded"],
              "ckpt_load_full_over_sharded": lmed["full"] / lmed["sharded"],
              "ckpt_save_ours_over_dcp": med["sharded"] / med["dcp"],
              "ckpt_save_over_disk_write":
                  sizes["sharded"] / med["sharded"] / (nbytes / dmed["write"]),
              "ckpt_load_over_disk_read": sizes["sharded"] / lmed["cold"] / (nbytes / dmed["read"])}
    cached = sizes["sharded"] / lmed["sharded"] / (nbytes / dmed["cached read"])
    print(f"   full/sharded: save {ratios['ckpt_save_full_over_sharded']:.3f}, load "
          f"{ratios['ckpt_load_full_over_sharded']:.3f}; ours sharded/plain DCP save "
          f"{ratios['ckpt_save_ours_over_dcp']:.3f} ({med['sharded'] - med['dcp']:+.2f} s)")
    print(f"   sharded save over the disk's fsync write: {ratios['ckpt_save_over_disk_write']:.3f}"
          f" (goal >= 0.8); load from the disk over its read: "
          f"{ratios['ckpt_load_over_disk_read']:.3f} (goal >= 0.8); load from the page cache "
          f"over a read from it: {cached:.3f}")
    return ratios


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world-size", type=int, default=4)
    ap.add_argument("--layers", type=int, default=3, help="GPT layers of ~50 MB fp32 each")
    ap.add_argument("--reps", type=int, default=5, help="saves and loads per variant")
    ap.add_argument("--steps", type=int, default=8, help="training steps per loop")
    ap.add_argument("--every", type=int, default=2, help="steps between checkpoints")
    ap.add_argument("--rounds", type=int, default=2, help="runs of each training loop")
    args = ap.parse_args()
    n = args.world_size
    root = tempfile.mkdtemp(prefix="mp-bench-checkpoint-", dir="/tmp")
    ratios = {}
    try:
        with WorkerGroup(n, case_timeout_s=1800, collective_timeout_s=600) as group:
            got = group.run(save_load_case, layers=args.layers, reps=args.reps, root=root)[0]
            print(f"GPT {_config(args.layers)}: {got['params'] / 1e6:.1f} M parameters, "
                  f"model + SGD momentum {_mb(got['state_bytes'])} fp32, FSDP over {n} gloo "
                  f"ranks on CPU; checkpoints under {root}")
            ratios.update(_report_save_load(got, args.reps, n))

            res = group.run(stall_case, layers=args.layers, steps=args.steps,
                            every=args.every, rounds=args.rounds, root=root)[0]
            mean = {k: {f: statistics.mean(r[f] for r in v) for f in ("total", "stall")}
                    for k, v in res.items()}
            base = mean["none"]["total"]
            saves = args.steps // args.every
            print(f"\ntraining loop, {args.steps} steps (batch {BATCH} x {SEQ} tokens per rank), "
                  f"a checkpoint every {args.every} ({saves} per loop), mean of "
                  f"{args.rounds} rounds:")

            def rounds(kind: str) -> str:
                return ", ".join(f"{r['total']:.2f}" for r in res[kind])

            print(f"   no checkpoint  loop {base:6.2f} s ({base / args.steps * 1e3:.0f} ms per "
                  f"step; rounds {rounds('none')} s)")
            for kind in ("blocking", "async"):
                calls = [c for r in res[kind] for c in r["calls"]]
                wait = statistics.mean(r["final_wait"] for r in res[kind])
                over = mean[kind]["total"] - base
                print(f"   {kind:8} save  loop {mean[kind]['total']:6.2f} s ({over:+.2f} s over "
                      f"none; rounds {rounds(kind)} s); in checkpoint calls "
                      f"{mean[kind]['stall']:.2f} s per loop (calls median "
                      f"{statistics.median(calls):.2f} s, max {max(calls):.2f} s"
                      + (f"; final wait {wait:.2f} s)" if kind == "async" else ")"))
            ratios["async_stall_over_blocking"] = mean["async"]["stall"] / \
                mean["blocking"]["stall"]
            extra = {k: mean[k]["total"] - base for k in ("blocking", "async")}
            final_wait = statistics.mean(r["final_wait"] for r in res["async"])
            with_wait = (mean["async"]["stall"] + final_wait) / mean["blocking"]["stall"]
            ratios["async_stall_with_final_wait_over_blocking"] = with_wait
            print(f"   stall async/blocking: in the calls "
                  f"{ratios['async_stall_over_blocking']:.3f} ({with_wait:.3f} counting the "
                  f"final wait); loop time over none "
                  f"{extra['async']:+.2f} s vs {extra['blocking']:+.2f} s (noisy: the steps "
                  f"are the bulk of the loop; the async writer also competes for the CPU)")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print("RATIOS " + " ".join(f"{k}={v:.4f}" for k, v in ratios.items()))


if __name__ == "__main__":
    main()
