"""examples/context_parallel/train_llama.py: each sequence split over 2 ranks trains what
one process trains on the whole sequences, so both print the same losses."""

import re


def test_context_parallel_example_prints_one_process_losses(modelparallel):
    printed = []
    for ranks, cp in ((1, 1), (2, 2)):
        ran = modelparallel("run", "--nproc-per-node", ranks,
                            "examples/context_parallel/train_llama.py", "--steps", 6,
                            "--log-every", 3, "--seq-len", 256,
                            "--context-parallel-degree", cp, timeout=600)
        assert ran.code == 0, ran.all
        steps = re.findall(r"step +\d+ \| loss ([\d.]+) \| (\d+) of 256 positions", ran.out)
        assert [int(n) for _, n in steps] == [256 // cp] * 2, ran.out
        printed.append([loss for loss, _ in steps])
    assert printed[0] == printed[1], printed
