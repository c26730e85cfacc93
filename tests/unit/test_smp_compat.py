"""The alias table of SageMaker module paths, both ways in: the import line
(``modelparallel.X``) and zero lines (``torch.sagemaker.X`` with the compat mode on)."""

import importlib
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import numpy as np
import pytest
import torch

import modelparallel
import modelparallel_compat as compat
from modelparallel.checkpoint import states
from modelparallel.checkpoint import user_content as codec

PYTHON = sys.executable


def _run(code: str, **env: str) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if k != compat.ENVIRONMENT_SWITCH}
    return subprocess.run([PYTHON, "-c", code], capture_output=True, text=True,
                          env={**environ, **env}, timeout=120)


def test_every_table_target_is_a_module_modelparallel_has():
    for table in (compat.MODELPARALLEL, compat.SAGEMAKER):
        for path, target in table.items():
            if target is not None:
                assert importlib.import_module(target).__name__ == target, path


def test_resolve_maps_whole_subtrees_and_only_in_sagemaker_mode():
    assert compat.resolve("torch.sagemaker", sagemaker=False) is None
    assert compat.resolve("torch.sagemaker", sagemaker=True) == "modelparallel"
    assert compat.resolve("torch.sagemaker.delayed_param", sagemaker=True) == \
        "modelparallel.delayed_param"
    assert compat.resolve("smdistributed.modelparallel.torch.nn.huggingface.gpt2",
                          sagemaker=True) == "modelparallel.nn.huggingface.gpt2"
    assert compat.resolve("smdistributed", sagemaker=True) == compat.NAMESPACE
    assert compat.resolve("smdistributed.tensorflow", sagemaker=True) == compat.MISSING
    assert compat.resolve("modelparallel.grad_norm", sagemaker=False) == \
        "modelparallel.smp.v2.grad_norm"
    assert compat.resolve("modelparallel.smp", sagemaker=False) is None  # real modules
    assert compat.resolve("torch.nn", sagemaker=True) is None


def test_import_line_paths_resolve_under_modelparallel():
    from modelparallel.grad_norm import clip_grad_norm_
    from modelparallel.test.torch.utils import dump_model, verify
    from modelparallel.utils import utils as tsm_utils
    from modelparallel.utils.process_group_utils import get_global_ranks

    assert clip_grad_norm_ is modelparallel.clip_grad_norm_
    assert callable(tsm_utils.timeit) and callable(get_global_ranks)
    assert callable(dump_model) and callable(verify)
    import modelparallel.checkpoint.utils as tsm_checkpoint  # attribute chain and module
    assert tsm_checkpoint.SORT_BY_LAST_INT("step_12_120steps") == 120


def test_zero_line_mode_needs_the_switch_and_leaves_torch_alone():
    code = ("import torch, torch.sagemaker as tsm, smdistributed.modelparallel\n"
            "import smdistributed.modelparallel.torch as smp\n"
            "import smdistributed.dataparallel.torch.torch_smddp\n"
            "from torch.sagemaker.delayed_param import DelayedParamIniter\n"
            "import modelparallel\n"
            "assert tsm.init is modelparallel.init and smp.DistributedModel is "
            "modelparallel.DistributedModel\n"
            "assert tsm.state is modelparallel.state\n"
            "print(smdistributed.modelparallel.__version__, torch.__file__)")
    on = _run(code, MODELPARALLEL_COMPAT="sagemaker")  # the .pth file reads the switch
    assert on.returncode == 0, on.stderr
    version, torch_file = on.stdout.split()
    assert version == modelparallel.__version__
    assert torch_file == torch.__file__  # the installed torch, untouched
    off = _run(code)
    assert off.returncode != 0 and "No module named 'torch.sagemaker'" in off.stderr


def test_the_pth_file_is_installed_next_to_the_packages():
    site = Path(sysconfig.get_paths()["purelib"])
    assert (site / "modelparallel-compat.pth").read_text() == \
        (Path(compat.__file__).parent / "modelparallel-compat.pth").read_text()


def test_unknown_mode_and_unprovided_paths_say_what_is_wrong():
    bad = _run("import modelparallel", MODELPARALLEL_COMPAT="sagemaker2")
    assert bad.returncode == 0
    assert "MODELPARALLEL_COMPAT='sagemaker2' is not a known mode; known: sagemaker" \
        in bad.stderr
    missing = _run("import smdistributed.tensorflow", MODELPARALLEL_COMPAT="sagemaker")
    assert "No module named 'smdistributed.tensorflow': modelparallel does not provide " \
           "SMP's smdistributed.tensorflow; docs/smp-compatibility.md" in missing.stderr
    attribute = _run("import torch.sagemaker as tsm; tsm.no_such_name",
                     MODELPARALLEL_COMPAT="sagemaker")
    assert "module 'torch.sagemaker' (modelparallel's modelparallel) has no attribute " \
           "'no_such_name'" in attribute.stderr


def test_user_content_keeps_numpy_values_and_hf_configs_without_unpickling():
    from transformers import GPT2Config

    content = {"loss": np.float32(0.25), "steps": np.int64(7), "ids": np.arange(6).reshape(2, 3),
               "names": np.array(["a", "bc"]), "config": GPT2Config(n_layer=3),
               "nested": [(np.bool_(True), "x")], "t": torch.ones(2)}
    data = states.check_safe("user_content", {"user_content": codec.encode(content)})
    back = codec.decode(states.load_safe(data)["user_content"])
    assert type(back["loss"]) is np.float32 and back["loss"] == np.float32(0.25)
    assert type(back["steps"]) is np.int64 and back["steps"] == 7
    assert back["ids"].dtype == np.int64 and (back["ids"] == content["ids"]).all()
    assert back["names"].tolist() == ["a", "bc"]
    assert type(back["config"]) is GPT2Config and back["config"].n_layer == 3
    assert back["nested"] == [(np.bool_(True), "x")] and torch.equal(back["t"], torch.ones(2))


def test_user_content_never_imports_what_a_checkpoint_names():
    forged = {codec.MARK: "transformers.config", "class": "os.system", "dict": {}}
    with pytest.raises(ValueError, match="not a transformers class"):
        codec.decode(forged)
    forged["class"] = "transformers.utils.logging.get_logger"
    with pytest.raises(ValueError, match="not a Hugging Face configuration class"):
        codec.decode(forged)
    with pytest.raises(states.CheckpointError, match=r"holds .*Path"):
        states.check_safe("user_content", codec.encode({"p": Path("/")}))


def test_checkpoint_utils_keep_the_newest_directories(tmp_path, capfd):
    from modelparallel.checkpoint.utils import SORT_BY_LAST_INT, limit_num_subdirs

    for step in (5, 40, 300, 7):
        (tmp_path / f"run_{step}steps").mkdir()
    (tmp_path / "other").mkdir()
    # SMP's v2 shared scripts call it on every rank with log=(rank == 0): "Both log
    # messages and do the actual remove as needed for one single rank" (checkpoints.py)
    kept = limit_num_subdirs(str(tmp_path), 2, sort_fn=SORT_BY_LAST_INT,
                             regex=r"^.*\d+steps$", log=False)
    assert kept == [] and len(list(tmp_path.iterdir())) == 5
    assert "removed" not in capfd.readouterr().err
    removed = limit_num_subdirs(str(tmp_path), 2, sort_fn=SORT_BY_LAST_INT,
                                regex=r"^.*\d+steps$", log=True)
    assert sorted(removed) == ["run_5steps", "run_7steps"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other", "run_300steps",
                                                          "run_40steps"]
    assert capfd.readouterr().err.count("modelparallel.script: removed old checkpoint") == 2
    assert limit_num_subdirs(str(tmp_path), None) == []


def test_test_utils_dump_and_verify(tmp_path):
    from modelparallel.test.torch.utils import dump_model, verify

    model = torch.nn.Linear(3, 2)
    path = dump_model(model, tmp_path / "a.pt")
    verify(path, model.state_dict())
    with torch.no_grad():
        model.bias[0] += 1e-3
    with pytest.raises(AssertionError, match=r"bias: differs by up to 0\.001"):
        verify(path, model.state_dict())


def test_sagemaker_estimator_parameters_override_the_script():
    import json

    from modelparallel.config import Config, ConfigError

    env = {"SM_HP_MP_PARAMETERS": json.dumps({"tensor_parallel_degree": 2, "ddp": True})}
    config = Config.load({"tensor_parallel_degree": 4, "microbatches": 2}, environ=env)
    assert (config.tensor_parallel_degree, config.microbatches) == (2, 2)
    env["MP_CONFIG"] = json.dumps({"tensor_parallel_degree": 8})
    with pytest.raises(ConfigError, match="SM_HP_MP_PARAMETERS says 2 but MP_CONFIG says 8"):
        Config.load({}, environ=env)


def test_v2_utilities_in_one_process():
    code = """
import torch.distributed as dist
import torch.sagemaker as tsm
from torch.sagemaker.logger import get_logger
from torch.sagemaker.utils import utils as tsm_utils
from torch.sagemaker.utils.process_group_utils import get_global_ranks

tsm.init()
assert tsm.is_initialized() and dist.is_initialized()
assert get_global_ranks(dist.group.WORLD) == [0] == get_global_ranks()
get_logger().info("hello from the script")
with tsm_utils.timeit(True, "Model creation", 0):
    pass
with tsm_utils.timeit(True, "not on this rank", 1):
    pass
tsm.shutdown()
assert not tsm.is_initialized() and not dist.is_initialized()
print("ok")
"""
    done = _run(code, MODELPARALLEL_COMPAT="sagemaker")
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr
    lines = [line for line in done.stderr.splitlines() if "modelparallel.script" in line]
    assert len(lines) == 2, done.stderr
    assert lines[0].endswith("INFO [rank 0] modelparallel.script: hello from the script")
    assert "Model creation took " in lines[1]


def test_v2_refusals_and_no_effect_calls(caplog):
    import logging

    import modelparallel.state_mod
    from modelparallel.context_parallel.utils import setup_transformer_engine_cp_groups
    from modelparallel.distributed.fsdp.fully_sharded_data_parallel import (
        register_tp_processing_pre_comm_hook,
    )
    from modelparallel.moe.moe_config import MoEConfig
    from modelparallel.moe.moe_layer import MoELayer
    from modelparallel.state_handler import state
    from modelparallel.tensor_parallel.transformer import TETransformerLayer

    assert state is modelparallel.state and modelparallel.state_mod.state is state
    with pytest.raises(NotImplementedError, match=r"uses no Transformer Engine modules: its "
                       r"context parallelism is built into tsm.transform"):
        setup_transformer_engine_cp_groups(None, [0, 1])
    with pytest.raises(TypeError, match=r"MoELayer is built from a Hugging Face sparse MoE "
                                        r"block .* not from MoEConfig: call tsm.transform"):
        MoELayer(MoEConfig())
    with pytest.raises(TypeError, match="TransformerEngine's layer, which modelparallel does "
                                        "not use"):
        TETransformerLayer()
    with caplog.at_level(logging.INFO, logger="modelparallel"):
        register_tp_processing_pre_comm_hook(torch.nn.Linear(2, 2))
    assert "register_tp_processing_pre_comm_hook has no effect" in caplog.text


@pytest.mark.parametrize("distribution,on", [
    ({"smdistributed": {"modelparallel": {"enabled": True, "parameters": {"ddp": True}}},
      "mpi": {"enabled": True, "processes_per_host": 1}}, True),
    ({"smdistributed": {"dataparallel": {"enabled": True}}}, True),
    ({"torch_distributed": {"enabled": True}}, False),
    (None, False),
])
def test_jobs_in_sagemaker_form_run_with_the_compat_switch(tmp_path, distribution, on):
    from modelparallel.jobs.instance import worker_environment
    from modelparallel.jobs.layout import JobLayout
    from modelparallel.jobs.spec import build_spec

    script = tmp_path / "train.py"
    script.write_text("import torch.sagemaker\n")
    spec = build_spec(entry_point=str(script), source_dir=None, instance_count=1,
                      processes_per_host=1, hyperparameters={}, distribution=distribution,
                      inputs=None, output_path=str(tmp_path / "out"), checkpoint_uri=None,
                      environment=None, max_run=None, max_restarts=0,
                      metric_definitions=None, backend="local", backend_options={},
                      name="job")
    env = worker_environment(spec, 0, {}, JobLayout(tmp_path / "job"), tmp_path)
    assert (env.get(compat.ENVIRONMENT_SWITCH) == "sagemaker") is on


def test_state_reset_forgets_the_initialization():
    done = _run("import torch.sagemaker as tsm\ntsm.init()\ntsm.state.reset()\n"
                "assert not tsm.is_initialized()\ntsm.init()\nprint(tsm.state.world_size)",
                MODELPARALLEL_COMPAT="sagemaker")
    assert done.returncode == 0 and done.stdout.strip() == "1", done.stderr
