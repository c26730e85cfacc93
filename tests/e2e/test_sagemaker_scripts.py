"""SageMaker-style scripts (examples/sagemaker), run the ways a user ports them: with
their imports unchanged (``modelparallel run --compat sagemaker``) and with the import
line changed (the SMDDP script both ways; the SMP v1 one with zero lines, the SMP v2 one
with the import line, to keep CI's time: every name resolves both ways in
tests/unit/test_smp_names.py, and scripts/sagemaker_examples.py runs public scripts both
ways). Each trains like one plain-PyTorch process: the loss of every step and
every parameter at the end. The comparisons train with SGD (the scripts' --optimizer
sgd; AdamW is their default): Adam divides every gradient element by its own size, so
float round-off in near-zero gradients, which any change of summation order brings,
would become visible parameter steps (examples/sagemaker/common.py)."""

import importlib.util
import json
import re
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples" / "sagemaker"
sys.path.insert(0, str(EXAMPLES))

import common  # noqa: E402  (the scripts' shared helpers)

# The import-line port, as the README gives it.
IMPORT_LINE = [
    ("import smdistributed.modelparallel.torch as smp", "import modelparallel as smp"),
    ("from smdistributed.modelparallel.torch", "from modelparallel"),
    ("import smdistributed.dataparallel.torch.torch_smddp",
     "import modelparallel.dataparallel"),
    ("import torch.sagemaker as tsm", "import modelparallel as tsm"),
    ("from torch.sagemaker", "from modelparallel"),
    ("import torch.sagemaker.", "import modelparallel."),
]


def variant(script: Path, way: str, directory: Path) -> Path:
    """The script as the user runs it: unchanged, or with the import line ported."""
    text = script.read_text()
    if way == "import line":
        for old, new in IMPORT_LINE:
            text = text.replace(old, new)
        imports = [line for line in text.splitlines() if line.startswith(("import ", "from "))]
        assert not [line for line in imports if "smdistributed" in line or
                    "torch.sagemaker" in line], imports
    path = directory / script.name
    path.write_text(text)
    (directory / "common.py").write_text((EXAMPLES / "common.py").read_text())
    return path


def run_both_ways(modelparallel, tmp_path, script, nproc, *args,
                  ways=("zero lines", "import line")):
    """Run ``script`` each way in ``ways``: its results (losses, parameters, output)."""
    results = {}
    for way in ways:
        directory = tmp_path / way.replace(" ", "_")
        directory.mkdir()
        path = variant(EXAMPLES / script, way, directory)
        compat = ["--compat", "sagemaker"] if way == "zero lines" else []
        ran = modelparallel("run", *compat, "--nproc-per-node", nproc, path,
                            "--out", directory / "out", *args, timeout=400)
        assert ran.code == 0, f"{way}:\n{ran.all}"
        losses = json.loads((directory / "out" / "losses.json").read_text())
        params = torch.load(directory / "out" / "params.pt", weights_only=True)
        results[way] = (losses, params, ran)
    return results


def assert_parity(results, ref_losses, ref_params, rtol=1e-5):
    for way, (losses, params, _) in results.items():
        assert len(losses) == len(ref_losses)
        for step, (a, b) in enumerate(zip(losses, ref_losses, strict=True)):
            assert abs(a - b) <= rtol * abs(b), f"{way}: step {step}: {a} vs {b}"
        assert set(params) == set(ref_params), f"{way}: {set(params) ^ set(ref_params)}"
        for name, ref in ref_params.items():
            diff = (params[name].float() - ref.float()).abs().max().item()
            assert diff <= rtol * ref.abs().max().item() + 1e-8, f"{way}: {name}: {diff}"


def load_ported(script: str, tmp_path: Path):
    """The import-line version of a script, imported as a module (for its classes)."""
    directory = tmp_path / "module"
    directory.mkdir(exist_ok=True)
    path = variant(EXAMPLES / script, "import line", directory)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def lm_reference(model_class, config, steps):
    """One plain process training what the GPT-2 and Llama scripts train (SGD, their LR
    schedule, clipping at 1.0): every step's loss and the final state dict."""
    torch.manual_seed(0)
    model = model_class(config)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
    losses = []
    for ids in common.token_batches(steps):
        loss = model(input_ids=ids, labels=ids)["loss"]
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, model.state_dict()


def test_smddp_script_both_ways(modelparallel, tmp_path):
    results = run_both_ways(modelparallel, tmp_path, "smddp_cnn.py", 2, "--steps", 4)
    script = load_ported("smddp_cnn.py", tmp_path)
    torch.manual_seed(0)
    model = script.Net()
    optimizer = torch.optim.Adadelta(model.parameters(), lr=1.0)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.7)
    losses = []
    for data, target in common.image_batches(4):
        optimizer.zero_grad()
        loss = F.nll_loss(model(data), target)
        loss.backward()
        optimizer.step()
        scheduler.step()
        losses.append(loss.item())
    assert_parity(results, losses, model.state_dict())


def test_smp_v1_script_both_ways(modelparallel, tmp_path):
    """GPT-2 replaced by smp.nn.DistributedTransformerLMHead (the script's default, as in
    SMP), pipeline 2 x tensor parallel 2, against the Hugging Face GPT-2 in one process."""
    pytest.importorskip("transformers")
    from transformers import GPT2LMHeadModel

    steps = 4
    # zero lines only: the import line is proven on the other scripts and, for every
    # name, by tests/unit/test_smp_names.py (CI's time is the limit)
    results = run_both_ways(modelparallel, tmp_path, "smp_v1_gpt2.py", 4, "--steps", steps,
                            "--restart_at", 2, "--checkpoint_dir", tmp_path / "ckpt",
                            "--optimizer", "sgd", "--lr", 0.05, ways=("zero lines",))
    for _, _, ran in results.values():  # the pipeline was cut in two (the script checks
        assert re.search(r"\[rank0\]:\s+1 ", ran.out), ran.out  # what it resumed)
        assert "GPT2LMHeadModel replaced by smp.nn's DistributedTransformerLMHead" in ran.all
    assert_parity(results, *lm_reference(GPT2LMHeadModel, common.gpt2_config(), steps))


def test_smp_v2_script_both_ways(modelparallel, tmp_path):
    pytest.importorskip("transformers")
    from transformers import LlamaForCausalLM

    steps = 4
    # the import line only; zero lines is proven on the other scripts (CI's time)
    results = run_both_ways(modelparallel, tmp_path, "smp_v2_fsdp.py", 4, "--steps", steps,
                            "--restart_at", 2, "--checkpoint_dir", tmp_path / "ckpt",
                            "--optimizer", "sgd", "--lr", 0.05, ways=("import line",))
    for _, _, ran in results.values():
        assert "Model creation took " in ran.all and "FSDP constructor took " in ran.all
    assert_parity(results, *lm_reference(LlamaForCausalLM, common.llama_config(), steps))
