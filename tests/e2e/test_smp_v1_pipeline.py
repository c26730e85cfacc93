"""An SMP v1 pipeline-parallel script, changed only in its import line, under the launcher."""

import ast
import importlib.util
import io
import json
import re
import subprocess
import sys
import tokenize
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "examples" / "pipeline" / "train_smp_v1.py"
CONFIG = {"pipeline_parallel_degree": 2, "microbatches": 4, "pipeline": "interleaved"}
STEPS = 30

# The public API of smdistributed.modelparallel.torch (SMP v1) that such a script may use.
SMP_V1_API = {
    "init", "step", "DistributedModel", "DistributedOptimizer", "partition", "set_partition",
    "rank", "size", "local_rank", "local_size", "dp_rank", "dp_size", "rdp_rank", "rdp_size",
    "mp_rank", "mp_size", "pp_rank", "pp_size", "tp_rank", "tp_size", "barrier", "dp_barrier",
    "mp_barrier", "allgather", "broadcast", "send", "recv_from", "save", "load",
    "WORLD", "DP_GROUP", "MP_GROUP", "PP_GROUP", "TP_GROUP", "RDP_GROUP", "CommGroup",
    "RankType", "get_world_process_group", "get_dp_process_group", "get_mp_process_group",
    "get_pp_process_group", "get_tp_process_group", "get_rdp_process_group", "state",
}

LOSS_LINE = re.compile(r"Train step +(\d+) \[epoch \d+\]\tLoss: ([\d.]+)")
FINAL_LINE = re.compile(r"\[rank0\]: Finished (\d+) steps in [\d.]+s: train loss ([\d.]+) -> "
                        r"([\d.]+); test loss ([\d.]+) -> ([\d.]+), accuracy ([\d.]+)%")


def test_script_differs_from_smp_v1_only_in_the_import_line():
    source = SCRIPT.read_text()
    code_lines = {tok.start[0] for tok in tokenize.generate_tokens(io.StringIO(source).readline)
                  if tok.type == tokenize.NAME and tok.string == "modelparallel"}
    lines = source.splitlines()
    mentions = [lines[n - 1] for n in sorted(code_lines)]
    assert mentions == [
        "import modelparallel as smp  # was: import smdistributed.modelparallel.torch as smp"]
    used = {node.attr for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
            and node.value.id == "smp"}
    assert used <= SMP_V1_API, f"not SMP v1 API: {sorted(used - SMP_V1_API)}"
    assert {"init", "DistributedModel", "DistributedOptimizer", "step", "rank", "dp_rank",
            "dp_size"} <= used


def _losses(output: str) -> dict[int, float]:
    return {int(step): float(loss) for step, loss in LOSS_LINE.findall(output)}


def test_smp_v1_script_trains_a_two_stage_pipeline(modelparallel, tmp_path, clean_env):
    if torch.cuda.device_count() < 2:  # two ranks need two GPUs; else both use the CPU
        clean_env["CUDA_VISIBLE_DEVICES"] = ""  # the env the `modelparallel` fixture runs in
    config, saved = tmp_path / "smp.json", tmp_path / "model.pt"
    config.write_text(json.dumps(CONFIG))
    args = ["--steps", STEPS, "--log-interval", 5]
    ran = modelparallel("run", "--nproc-per-node", 2, "--config", config, SCRIPT, *args,
                        "--save", saved, timeout=180)
    assert ran.code == 0, ran.all
    print(f"2 ranks, pipeline_parallel_degree 2: {ran.seconds:.1f}s")

    # the launcher's config reached smp.init() and the model was cut into 2 stages
    assert "pp_size 2, dp_size 1" in ran.out
    assert re.search(r"\[rank0\]:     0  embed, fc_in \+ blocks\.\d", ran.out), ran.out
    assert re.search(r"\[rank0\]:     1  blocks\.\d .* \+ norm, fc_out", ran.out), ran.out
    assert "[rank1]: Train step" not in ran.out, "only rank 0 prints"

    losses = _losses(ran.out)
    assert sorted(losses) == [1, 5, 10, 15, 20, 25, 30]
    done = FINAL_LINE.search(ran.out)
    assert done, ran.out
    steps, first, last, test_before, test_after, accuracy = map(float, done.groups())
    assert steps == STEPS
    assert losses[1] > 5.0, "byte-level loss starts near ln 256"
    assert last < first - 0.5 and test_after < test_before - 2.0
    assert accuracy > 20.0

    # the same script in one plain process (no launcher, no pipeline) learns the same
    single = subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], cwd=REPO,
                            env=clean_env, capture_output=True, text=True, timeout=120)
    assert single.returncode == 0, single.stdout + single.stderr
    reference = _losses(single.stdout)
    assert sorted(reference) == sorted(losses)
    for step, loss in losses.items():
        assert abs(loss - reference[step]) < 2e-3, (step, loss, reference[step])

    # rank 0 saved the whole model: every stage's parameters, trained and finite
    state = torch.load(saved, weights_only=True)
    spec = importlib.util.spec_from_file_location("train_smp_v1", SCRIPT)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    torch.manual_seed(1)  # the script's default seed: its initial weights
    initial = script.Net().state_dict()
    assert set(state) == set(initial)
    for name, value in state.items():
        assert value.shape == initial[name].shape, name
        assert value.device.type == "cpu", name
        assert torch.isfinite(value).all(), name
    for name in ("embed.weight", "fc_in.weight", "blocks.0.fc1.weight",  # stage 0
                 "blocks.3.fc2.weight", "fc_out.weight"):                 # stage 1
        assert not torch.equal(state[name], initial[name]), f"{name} was not trained"


def test_an_error_on_the_last_stage_ends_every_stage(modelparallel, tmp_path, clean_env):
    """The first stage waits for gradients the failed last stage never sends; the
    launcher stops it and names the failing rank with its traceback."""
    clean_env["CUDA_VISIBLE_DEVICES"] = ""
    path = tmp_path / "train.py"
    path.write_text(
        "import torch\n"
        "import modelparallel as smp\n"
        "smp.init({'pipeline_parallel_degree': 2, 'microbatches': 2})\n"
        "model = smp.DistributedModel(torch.nn.Sequential(*[torch.nn.Linear(8, 8)\n"
        "                                                   for _ in range(4)]))\n"
        "@smp.step\n"
        "def train_step(model, x, step):\n"
        "    loss = model(x).pow(2).mean()\n"
        "    if step == 2:\n"
        "        raise ValueError('loss went bad at step 2')\n"
        "    model.backward(loss)\n"
        "    return loss\n"
        "for step in range(4):\n"
        "    train_step(model, torch.ones(4, 8), step)\n")
    ran = modelparallel("run", "--nproc-per-node", 2, path, timeout=120)
    assert ran.code == 1, ran.all
    summary = ran.err[ran.err.index("modelparallel run: rank"):]
    assert "rank 1 (local rank 1) failed first with exit code 1" in summary
    assert "ValueError: loss went bad at step 2" in summary
    # rank 0 ends too: stopped by the launcher, or failing first on the closed connection
    assert re.search(r"(stopped by the launcher|also failed): rank\(s\) 0", summary), summary


def test_smp_v1_script_trains_in_3d_layouts(modelparallel, tmp_path, clean_env):
    """The same script, 4 ranks: 2 virtual stages per rank x sharded data parallel 2.
    Each data-parallel replica reads its own samples, so the losses are not those of
    one process; the model must still learn (it evaluates before training, too)."""
    clean_env["CUDA_VISIBLE_DEVICES"] = ""
    config = tmp_path / "smp.json"
    config.write_text(json.dumps({"pipeline_parallel_degree": 2, "microbatches": 4,
                                  "pipeline": "interleaved_1f1b", "hybrid_shard_degree": 2}))
    ran = modelparallel("run", "--nproc-per-node", 4, "--config", config, SCRIPT,
                        "--steps", STEPS, timeout=180)
    assert ran.code == 0, ran.all
    assert "pp_size 2, dp_size 2" in ran.out
    done = FINAL_LINE.search(ran.out)
    assert done, ran.out
    _, first, last, test_before, test_after, accuracy = map(float, done.groups())
    assert last < first - 0.5 and test_after < test_before - 2.0
    assert accuracy > 20.0
