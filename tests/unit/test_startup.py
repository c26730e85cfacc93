"""Start-up: ``modelparallel --help`` imports only what the command line needs, and
``import modelparallel`` waits for the first name it is asked for (bench/startup.py
times both)."""

import subprocess
import sys

# What training needs and --help does not: each costs seconds at start-up (DTensor and
# FSDP pull in sympy and torch._dynamo) or is an optional dependency.
NOT_FOR_HELP = ("torch.distributed.tensor", "torch.distributed.fsdp",
                "torch.distributed.pipelining", "torch._dynamo", "sympy", "transformers",
                "matplotlib", "tensorboard", "ray", "modelparallel.smp",
                "modelparallel.parallel")


def _imported(*args: str) -> set[str]:
    ran = subprocess.run([sys.executable, "-X", "importtime", *args], capture_output=True,
                         text=True, timeout=300)
    assert ran.returncode == 0, ran.stderr[-2000:]
    return {line.rsplit("|", 1)[1].strip() for line in ran.stderr.splitlines()
            if line.startswith("import time:") and line.count("|") == 2}


def test_help_imports_nothing_that_training_needs():
    modules = _imported("-m", "modelparallel", "--help")
    heavy = sorted(m for m in modules if m.startswith(NOT_FOR_HELP))
    assert not heavy, heavy
    # torchrun --help imports torch; ours need not (every command's parser is torch-free)
    assert "torch" not in modules


def test_the_plan_arguments_offer_the_planners_names():
    from modelparallel.launch.plan_arguments import DEVICE_PROFILES, OPTIMIZERS
    from modelparallel.plan.device_model import PROFILES
    from modelparallel.plan.workload import OPTIMIZERS as PLANNED

    assert OPTIMIZERS == PLANNED
    assert tuple(sorted(PROFILES)) == DEVICE_PROFILES


def test_import_modelparallel_imports_no_torch_until_a_name_is_used():
    modules = _imported("-c", "import modelparallel")
    assert "torch" not in modules


def test_every_public_name_is_there_on_first_use():
    code = ("import modelparallel as mp; from modelparallel.observe import report; "
            "missing = [n for n in mp.__all__ if not hasattr(mp, n)]; "
            "assert not missing, missing; "
            "assert mp.observe.__name__ == 'modelparallel.smp.observe', mp.observe; "
            "assert mp.checkpoint.__name__ == 'modelparallel.smp.checkpoints'; "
            "from modelparallel.parallel.tensor.plans import builtin_names; "
            "assert 'GPT' in builtin_names()")
    ran = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300)
    assert ran.returncode == 0, ran.stderr[-2000:]
