"""scripts/sagemaker_examples.py --compare-one-process: the figures read from the SMP v2
shared-scripts' log line and the verdict of the comparison (the runs themselves need the
public repository: docs/smp-compatibility.md)."""

import json
import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

import sagemaker_examples
from examples_catalog_smp2 import SMP2_CP, SMP2_MOE

# The shared-scripts' line (logging_utils.py) with the catalog's gradnorm edit (%.9g).
LINE = ("[rank0]: 2026-11-28 23:35:10 I [logging_utils.py:134] Batch {step} Loss: {loss}, "
        "Speed: 23.85 samples/sec, Model TFLOPS/GPU: 0.00, lr: 0.000098, gradnorm: {norm}\n")


def log(loss: float, norm: float) -> str:
    return (LINE.format(step=0, loss=loss, norm=norm) +
            LINE.format(step=1, loss=loss + 1, norm=norm + 1))


def test_figures_are_batch_0s():
    pattern = SMP2_CP[0].one_process.figures
    assert sagemaker_examples.figures(pattern, log(6.945084571838379, 1.80513299)) == {
        "loss": 6.945084571838379, "grad_norm": 1.80513299}
    assert sagemaker_examples.figures(pattern, "no such line") == {}


@pytest.mark.parametrize("one_norm, verdict", [(1.80513287, "equal"), (1.8052, "FAIL: differ")])
def test_compare_with_one_process(one_norm, verdict):
    example = SMP2_CP[0]

    def run_one(one_process):
        assert one_process
        return "pass (3s)", "12", log(6.945085048675537, one_norm)

    compared = sagemaker_examples.compare_with_one_process(
        example, "zero-lines", log(6.945084571838379, 1.80513299), run_one)
    assert compared.startswith(verdict), compared
    assert "grad_norm 1.80513299 vs" in compared


def test_a_failed_one_process_run_fails_the_comparison():
    compared = sagemaker_examples.compare_with_one_process(
        SMP2_CP[0], "import-line", log(1.0, 1.0), lambda one_process: ("FAIL: boom", "12", ""))
    assert compared == "FAIL: the one-process run: FAIL: boom"


def test_cp_examples_ask_for_context_parallel_2_on_4_ranks():
    assert {e.name for e in SMP2_CP} == {"smp2-cp2-p2p", "smp2-cp2-all-gather"}
    for example in SMP2_CP:
        params = json.loads(example.env["SM_HP_MP_PARAMETERS"])
        assert params == {"context_parallel_degree": 2, "hybrid_shard_degree": 2}
        assert example.nproc == 4
        args = dict(zip(example.args[::2], example.args[1::2], strict=True))
        assert args["--use_smp_implementation"] == "1"  # else the script resets cp to 1
        assert args["--model_type"] == "llama_v2"
        # the script's global batch in tokens is world x width x batch / cp: 128 only at cp 2
        gbs = 4 * int(args["--max_context_width"]) * int(args["--train_batch_size"]) // 2
        line = (f"Global batch size in tokens: {gbs:10d} ( 0.00M).\n"
                "FSDP training finished successfully")
        assert re.search(example.success, line)
        assert not re.search(example.success, line.replace(f"{gbs:10d}", f"{2 * gbs:10d}"))


def test_moe_example_asks_for_expert_parallel_2_by_hybrid_shard_2_on_4_ranks():
    params = json.loads(SMP2_MOE.env["SM_HP_MP_PARAMETERS"])
    assert params == {"expert_parallel_degree": 2, "hybrid_shard_degree": 2}
    assert SMP2_MOE.nproc == 4
    args = dict(zip(SMP2_MOE.args[::2], SMP2_MOE.args[1::2], strict=True))
    assert (args["--model_type"], args["--moe"], args["--use_smp_implementation"],
            args["--num_local_experts"], args["--num_experts_per_tok"],
            args["--hidden_width"], args["--num_layers"]) == (
        "mixtral", "1", "1", "4", "2", "64", "2")
    assert args["--moe_load_balancing"] == "aux_loss"  # sinkhorn depends on a rank's tokens
    assert SMP2_MOE.one_process is not None
    one = json.loads(SMP2_MOE.one_process.env["SM_HP_MP_PARAMETERS"])
    assert one.get("expert_parallel_degree", 1) == 1
    # no edit touches how the scripts build the MoEConfig
    assert not any("MoEConfig" in e.old or "smp_moe" in e.old for e in SMP2_MOE.edits)
