"""examples/gpt/train_padded.py: padded lines, loss_sum / mp.global_token_count(labels).

Data parallelism over 2 ranks and tensor parallelism over 2 ranks both train what one
process trains on the global batch, so they print the same losses."""

import re


def test_padded_example_trains_alike_under_data_and_tensor_parallelism(modelparallel):
    printed = []
    for layout in ([], ["--tensor-parallel-degree", 2]):
        ran = modelparallel("run", "--nproc-per-node", 2, "examples/gpt/train_padded.py",
                            "--steps", 10, "--log-every", 5, *layout, timeout=600)
        assert ran.code == 0, ran.all
        printed.append(re.findall(r"step +\d+ \| loss ([\d.]+) \| (\d+) tokens", ran.out))
        first, last = map(float, re.search(r"token-mean loss ([\d.]+) -> ([\d.]+)",
                                           ran.out).groups())
        assert last < first - 1.0, "byte-level loss starts near ln 256 and falls"
    assert len(printed[0]) == 2 and printed[0] == printed[1], printed
