"""The SMP v1 pipeline example (train_smp_v1.py: its model, data and step function)
with modelparallel's step metrics and one recorded pipeline schedule, so that the run's
report.html has every figure: loss, throughput, step time, memory, communication, and
the schedule of each microbatch on each pipeline rank.

    echo '{"pipeline_parallel_degree": 2, "microbatches": 4}' > pp.json
    modelparallel run --nproc-per-node 2 --config pp.json examples/pipeline/train_observed.py

make_report_image.py runs it so and takes the README's picture of the report.
"""

import argparse
import contextlib

import torch
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from train_smp_v1 import Net, PythonSourceBytes, read_stdlib_source, train_step

import modelparallel as smp


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--batch-size", type=int, default=64,
                        help="samples per data-parallel rank per step")
    parser.add_argument("--record-step", type=int, default=10,
                        help="the step whose pipeline schedule is recorded")
    parser.add_argument("--log-interval", type=int, default=10)
    args = parser.parse_args()

    smp.init()
    torch.manual_seed(1)  # the same initial weights on every rank
    train_set = PythonSourceBytes(read_stdlib_source(400_000), context=16)
    sampler = DistributedSampler(train_set, num_replicas=smp.dp_size(), rank=smp.dp_rank(),
                                 shuffle=True, seed=1, drop_last=True)
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, drop_last=True)
    model = smp.DistributedModel(Net(context=16))
    optimizer = smp.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=3e-3))
    # rank 0 writes every step into the run directory (metrics.jsonl) for report.html
    metrics = smp.observe.StepMetrics(total_steps=args.steps, print_every=args.log_interval)

    step, epoch = 0, 0
    while step < args.steps:
        sampler.set_epoch(epoch)
        for data, target in loader:
            step += 1
            # every pipeline rank records the same step; rank 0 writes schedule.json
            recording = (model.record_schedule() if step == args.record_step
                         else contextlib.nullcontext())
            with metrics.step(samples=args.batch_size * smp.dp_size()) as rec, recording:
                optimizer.zero_grad()
                rec.loss = train_step(model, data, target).reduce_mean()
                optimizer.step()
            if step == args.steps:
                break
        epoch += 1
    metrics.close()


if __name__ == "__main__":
    main()
