"""The public SageMaker example scripts sagemaker_examples.py runs: where each is pinned, how it
is launched, and every edit made to it (the porting rules of issue 16), each with its reason."""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

SAGEMAKER_EXAMPLES = "aws/amazon-sagemaker-examples"
HEAD = "2d519b52c3a2c2361f2b87f0d3de46fd6c0232a5"  # aws/amazon-sagemaker-examples, main, 2025
# At the head the top-level folders' names start with spaces (they sort the listing on GitHub).
SMDDP_DIR = "      build_and_train_models/sm-distributed_data_parallelism_pytorch/code"
V2_DIR = "      build_and_train_models/sm-distributed_model_parallel_v2/shared-scripts"
OLD_SMDDP_DIR = "training/distributed_training/pytorch/data_parallel/mnist/code"
V1_MNIST = "training/distributed_training/pytorch/model_parallel/mnist/utils/pt_mnist.py"
V1_GPT2_DIR = "training/distributed_training/pytorch/model_parallel/gpt2"


@dataclass
class Edit:
    """One exact search/replace in one file of an example; ``kind`` is device, data, nvidia,
    size, world, bug, dep (a package not installed here), env (SageMaker container paths) or
    torch (an extension of SMP's own torch build that upstream torch lacks)."""

    file: str
    old: str
    new: str
    kind: str
    why: str
    count: int = 1


@dataclass
class OneProcess:
    """How ``--compare-one-process`` runs an example on one process: its files, edits and
    arguments, on 1 rank with ``env`` (its SMP parameters there); the figures compared are
    the named groups of the regex ``figures`` (first match in the output; every rank's
    output counts, the first rank's comes first), equal within ``rtol``."""

    env: dict[str, str]
    figures: str
    rtol: float = 1e-5


@dataclass
class Example:
    """A public script, pinned, with its launch and its edits."""

    name: str
    repo: str
    commit: str
    files: dict[str, str]  # path in the scratch copy -> path in the repository
    entry: str
    args: list[str]
    nproc: int
    edits: list[Edit]
    note: str
    env: dict[str, str] = field(default_factory=dict)
    deps: tuple[str, ...] = ()
    workdir: str = "."
    setup: Callable[[Path], None] | None = None
    success: str | None = None  # a regex the output must contain besides exit code 0
    then: list[str] | None = None  # arguments added for a second run in the same folder (resume)
    one_process: OneProcess | None = None  # the one-process run its figures are compared with


# torchvision is not installed here, and MNIST would be downloaded: a synthetic set of MNIST's
# shape (1x28x28 images, 10 classes) stands in for torchvision.datasets.MNIST.
SYNTHETIC_MNIST = """class _SyntheticMNIST(torch.utils.data.Dataset):
    def __init__(self, root, train=True, download=False, transform=None):
        g = torch.Generator().manual_seed(0 if train else 1)
        n = 256 if train else 128
        self.data = torch.randn(n, 1, 28, 28, generator=g)
        self.targets = torch.randint(0, 10, (n,), generator=g)

    def __len__(self):
        return len(self.targets)

    def __getitem__(self, i):
        return self.data[i], self.targets[i]


class datasets:  # torchvision.datasets
    MNIST = _SyntheticMNIST


class transforms:  # torchvision.transforms: the synthetic data is already normalized tensors
    Compose = ToTensor = Normalize = staticmethod(lambda *a, **k: None)
"""


def _mnist_edits(file: str) -> list[Edit]:
    """What both SMDDP MNIST scripts need: synthetic data, CPU, any world size."""
    return [
        Edit(file, "import torchvision\n", "", "data", "torchvision (MNIST download) not used"),
        Edit(file, "from torchvision import datasets, transforms\n", SYNTHETIC_MNIST, "data",
             "MNIST download -> synthetic data of MNIST's shape (torchvision is not installed)"),
        Edit(file, "if Version(torchvision.__version__) < Version(TORCHVISION_VERSION):",
             "if False:", "data", "no torchvision; the download mirrors are not used"),
        Edit(file, "    args.batch_size //= args.world_size // 8\n",
             "    args.batch_size //= max(args.world_size // 8, 1)\n", "world",
             "assumes at least 8 ranks (division by zero below 8)"),
        Edit(file, "    if not torch.cuda.is_available():\n", "    if False:\n", "device",
             "CPU: the CUDA check is skipped"),
        Edit(file, '    device = torch.device("cuda")\n', '    device = torch.device("cpu")\n',
             "device", "CUDA -> CPU"),
        Edit(file, "    torch.cuda.set_device(local_rank)\n    model.cuda(local_rank)\n", "",
             "device", "CUDA -> CPU: no device to set, the model stays on the CPU"),
    ]


SMDDP_MNIST = Example(
    name="smddp-mnist",
    repo=SAGEMAKER_EXAMPLES,
    commit=HEAD,
    files={"train_pytorch_smdataparallel_mnist.py":
           f"{SMDDP_DIR}/train_pytorch_smdataparallel_mnist.py",
           "model_def.py": f"{SMDDP_DIR}/model_def.py"},
    entry="train_pytorch_smdataparallel_mnist.py",
    args=["--epochs", "1", "--test-batch-size", "128", "--data-path", "{dest}/data"],
    nproc=2,
    note="SMDDP >= 1.4: import torch_smddp, init_process_group(backend='smddp'), torch DDP",
    edits=[*_mnist_edits("train_pytorch_smdataparallel_mnist.py"),
           Edit("train_pytorch_smdataparallel_mnist.py",
                "from torch.utils.tensorboard import SummaryWriter\n", "", "dep",
                "tensorboard is not installed; the writer is off (below)"),
           Edit("train_pytorch_smdataparallel_mnist.py",
                "    writer = SummaryWriter('/opt/ml/output/tensorboard') if rank == 0 and "
                "local_rank == 0 else None\n", "    writer = None\n", "dep",
                "tensorboard is not installed (and /opt/ml is SageMaker's container path)")],
    success=r"Test set: Average loss",
)

SMDDP_MNIST_V13 = Example(
    name="smddp-mnist-v1.3",
    repo=SAGEMAKER_EXAMPLES,
    commit="e0c01d7584ee8ce134eab9b91ab1d318d040cfaa",
    files={"train_pytorch_smdataparallel_mnist.py":
           f"{OLD_SMDDP_DIR}/train_pytorch_smdataparallel_mnist.py",
           "model_def.py": f"{OLD_SMDDP_DIR}/model_def.py"},
    entry="train_pytorch_smdataparallel_mnist.py",
    args=["--epochs", "1", "--test-batch-size", "128", "--data-path", "{dest}/data"],
    nproc=2,
    note="SMDDP <= 1.3 API: smdistributed.dataparallel.torch.distributed as dist, its DDP",
    edits=_mnist_edits("train_pytorch_smdataparallel_mnist.py"),
    success=r"Test set: Average loss",
)

SMP1_MNIST = Example(
    name="smp1-mnist",
    repo=SAGEMAKER_EXAMPLES,
    commit="187e52fc3db844645b469cc35122ccbc188357a1",
    files={"pt_mnist.py": V1_MNIST},
    entry="pt_mnist.py",
    args=[],
    nproc=2,
    note="SMP v1, a CNN (conv, conv | linear, linear) pipelined over 2 partitions, 4 "
         "microbatches, smp.amp.GradScaler, smp.save partial (config of its notebook)",
    env={"SM_HP_MP_PARAMETERS": json.dumps({
        "microbatches": 4, "placement_strategy": "spread", "pipeline": "interleaved",
        "optimize": "speed", "partitions": 2, "ddp": True})},
    edits=[
        Edit("pt_mnist.py", "from torchnet.dataset import SplitDataset\n",
             "SplitDataset = None\n", "dep",
             "torchnet is not installed; SplitDataset is used only when dp_size() > 1 (1 here)"),
        Edit("pt_mnist.py", "from torchvision import datasets, transforms\n", SYNTHETIC_MNIST,
             "data", "MNIST download -> synthetic data of MNIST's shape"),
        Edit("pt_mnist.py", "    if not torch.cuda.is_available():\n", "    if False:\n",
             "device", "CPU: the CUDA check is skipped"),
        Edit("pt_mnist.py",
             '    torch.cuda.set_device(smp.local_rank())\n    device = torch.device("cuda")\n',
             '    device = torch.device("cpu")\n', "device", "CUDA -> CPU"),
        Edit("pt_mnist.py", "        sync_local_checkpoints_to_s3(local_path=\"/opt/ml/"
             "local_checkpoints\", s3_path=full_s3_path)\n", "", "env", "no S3 upload here"),
        Edit("pt_mnist.py", '"/opt/ml/local_checkpoints"', "LOCAL_CKPT", "env",
             "SageMaker's container path -> the scratch directory", count=2),
        Edit("pt_mnist.py", 'f"/opt/ml/local_checkpoints/pt_mnist_checkpoint.pt"',
             'f"{LOCAL_CKPT}/pt_mnist_checkpoint.pt"', "env",
             "SageMaker's container path -> the scratch directory"),
    ],
)
# pt_mnist's checkpoint folder: a module-level name the env edits above refer to.
SMP1_MNIST.edits.insert(0, Edit(
    "pt_mnist.py", "torch.backends.cudnn.deterministic = True\n",
    "torch.backends.cudnn.deterministic = True\nLOCAL_CKPT = os.path.join(os.getcwd(), "
    "'local_checkpoints')\n", "env", "where SageMaker's /opt/ml/local_checkpoints goes here"))


def _gpt2_data(dest: Path) -> None:
    """Synthetic openwebtext-format JSON lines (what data_pipeline.py reads) for GPT-2."""
    rng = random.Random(0)
    for split, n in (("train", 64), ("test", 16)):
        folder = dest / "data" / split
        folder.mkdir(parents=True, exist_ok=True)
        with open(folder / f"{split}_synthetic.json", "w") as f:
            for _ in range(n):
                ids = [rng.randrange(1000) for _ in range(32)]
                f.write(json.dumps({"input_ids": ids, "attention_mask": [1] * 32}) + "\n")


GPT2_FILES = ["train_gpt_simple.py", "data_pipeline.py", "learning_rates.py",
              "memory_tracker.py", "sharded_data_parallel_checkpoint.py"]
SMP1_GPT2_ARGS = [
    "--max_steps", "4", "--fp16", "0", "--logging_freq", "1", "--checkpoint_freq", "2",
    "--use_wiki_data", "0", "--zipped_data", "0", "--epochs", "1",
    "--training-dir", "{dest}/data/train", "--test-dir", "{dest}/data/test",
    "--checkpoint-dir", "{dest}/checkpoints", "--model-dir", "{dest}/model",
    "--output-data-dir", "{dest}/output",
    "--max_context_width", "32", "--vocab_size", "1000", "--hidden_width", "64",
    "--num_layers", "2", "--num_heads", "2", "--train_batch_size", "4", "--val_batch_size", "4",
    "--lr_decay_iters", "10", "--validation_freq", "2", "--validation_batches", "2",
    "--save_final_full_model", "1", "--manual_partition", "1",
    "--lr", "0.0002", "--min_lr", "0.00001", "--lr_decay_style", "linear", "--warmup", "0.01",
]


def _smp1_gpt2(name: str, smp_args: list[str], note: str) -> Example:
    return Example(
        name=name,
        repo=SAGEMAKER_EXAMPLES,
        commit="01dbfb67a51210341e1671516bd807464a787ab2",
        files={f: f"{V1_GPT2_DIR}/{f}" for f in GPT2_FILES},
        entry="train_gpt_simple.py",
        args=[*SMP1_GPT2_ARGS, *smp_args],
        nproc=2,
        note=note + " (train_gpt_simple.py as of b7272f063, its last change)",
        env={"SM_NUM_GPUS": "0", "SM_OUTPUT_DATA_DIR": "{dest}/output",
             "SM_MODEL_DIR": "{dest}/model", "SM_CHANNEL_TRAIN": "{dest}/data/train",
             "SM_CHANNEL_TEST": "{dest}/data/test"},
        deps=("psutil", "h5py"),
        setup=_gpt2_data,
        success=r"SMP training finished successfully",
        then=["--load_partial", "1", "--max_steps", "6"],  # resume from the newest checkpoint
        edits=[Edit("train_gpt_simple.py",
                    '    torch.cuda.set_device(smp.local_rank())\n'
                    '    device = torch.device("cuda")\n',
                    '    device = torch.device("cpu")\n', "device", "CUDA -> CPU")],
    )


SMP1_GPT2_PP = _smp1_gpt2(
    "smp1-gpt2-pp2", ["--pipeline_parallel_degree", "2", "--microbatches", "2",
                      "--use_distributed_transformer", "0"],
    "SMP v1 GPT-2, pipeline 2 x 2 microbatches, manual partition, checkpoints")
SMP1_GPT2_TP = _smp1_gpt2(
    "smp1-gpt2-tp2", ["--tensor_parallel_degree", "2", "--use_distributed_transformer", "1",
                      "--prescaled_batch", "0"],
    "SMP v1 GPT-2, tensor parallel 2: GPT-2 replaced by smp.nn's DistributedTransformerLMHead "
    "(the script's default), checkpoint and resume")

SMP1_GPT2_TP_HF = _smp1_gpt2(
    "smp1-gpt2-tp2-hf", ["--tensor_parallel_degree", "2", "--use_distributed_transformer", "0",
                         "--prescaled_batch", "0"],
    "SMP v1 GPT-2, tensor parallel 2 with --use_distributed_transformer 0: replaced too (the "
    "script marks the model when tp_size() > 1) and read as transformer.h, checkpoints")

EXAMPLES: list[Example] = [SMDDP_MNIST, SMDDP_MNIST_V13, SMP1_MNIST, SMP1_GPT2_PP, SMP1_GPT2_TP,
                           SMP1_GPT2_TP_HF]
