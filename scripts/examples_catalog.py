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


V2_FILES = [
    "train.py", "train_lib.py", "train_utils.py", "arguments.py", "checkpoints.py",
    "fsdp_utils.py", "learning_rates.py", "logging_utils.py", "memory_tracker.py", "utils.py",
    "data_utils.py", "data/__init__.py", "data/utils.py", "data/dataset/__init__.py",
    "data/dataset/dummy_dataset.py", "data/dataset/gpt_dataset.py", "data/pipelines/__init__.py",
    "data/pipelines/data_pipeline.py", "data/pipelines/dummy_data_pipeline.py",
    "data/pipelines/gpt_data_pipeline.py", "data/pipelines/hf_data_pipeline.py",
    "data/pipelines/nemo_megatron_gpt_data_pipeline.py",
]
V2_ARGS = [
    "--model_type", "gpt_neox", "--hidden_width", "64", "--num_layers", "2", "--num_heads", "4",
    "--max_context_width", "64", "--vocab_size", "1024", "--train_batch_size", "2",
    "--val_batch_size", "2", "--epochs", "1", "--bf16", "0", "--fp8", "0",
    "--use_synthetic_data", "1", "--zipped_data", "0", "--logging_freq", "1",
    "--lr_decay_iters", "10", "--delayed_param", "1", "--activation_checkpointing", "1",
    "--sharding_strategy", "hybrid_shard", "--checkpoint_dir", "{dest}/checkpoints",
    "--checkpoint_freq", "2", "--num_kept_checkpoints", "2",
    # RoPE buffers need no move to the device on the CPU (and Hugging Face 5 moved them)
    "--patch_neox_rope", "0",
]
V2_EDITS = [
    Edit("train_lib.py",
         "import transformer_engine\nfrom transformer_engine.common.recipe import Format, "
         "DelayedScaling\n", "", "nvidia", "TransformerEngine (FP8) removed; run with --fp8 0"),
    Edit("train_lib.py", "    device = global_rank % torch.cuda.device_count()\n",
         '    device = torch.device("cpu")\n', "device", "CUDA -> CPU"),
    Edit("train_lib.py", "    torch.cuda.set_device(device)\n", "", "device",
         "CUDA -> CPU: no device to set"),
    Edit("train_lib.py", "            device_id=torch.cuda.current_device(),\n",
         '            device_id=torch.device("cpu"),\n', "device", "CUDA -> CPU"),
    Edit("train_lib.py", "    torch.cuda.synchronize()\n", "", "device",
         "CUDA -> CPU: nothing to synchronize", count=2),
    Edit("train_lib.py", "        nvtx_warmup_iters = 3\n",
         '        nvtx_warmup_iters = float("inf")\n', "device",
         "NVTX ranges are CUDA-only: never started"),
    Edit("train_utils.py", 'attn_implementation="flash_attention_2"',
         'attn_implementation="sdpa"', "nvidia",
         "FlashAttention-2 is CUDA-only: PyTorch's SDPA instead", count=2),
    Edit("data/pipelines/hf_data_pipeline.py", "from datasets import load_from_disk\n",
         "load_from_disk = None\n", "dep",
         "the datasets package is not installed; only --dataset_type hf uses it"),
    Edit("checkpoints.py", "            statistics.stdev(times),\n",
         "            statistics.stdev(times) if len(times) > 1 else 0.0,\n", "world",
         "stdev of a one-rank checkpoint group fails (tensor parallel 2 over 2 ranks: one "
         "data-parallel rank)"),
    Edit("checkpoints.py", "            process_group=model.process_group,\n        )\n",
         "        )\n", "torch", "SMP's own torch build takes process_group= in "
         "load_sharded_optimizer_state_dict; upstream torch does not (the default group is used)"),
    Edit("checkpoints.py", "    return min(model_pg_ranks)\n",
         "    return dist.get_group_rank(process_group, min(model_pg_ranks))\n", "bug",
         "torch.distributed.checkpoint (torch >= 2.5) reads coordinator_rank as a rank within "
         "process_group; the script passes a global rank"),
]


def _smp2(name: str, params: dict, args: list[str], note: str) -> Example:
    return Example(
        name=name,
        repo=SAGEMAKER_EXAMPLES,
        commit=HEAD,
        files={f: f"{V2_DIR}/{f}" for f in V2_FILES},
        entry="train.py",
        args=[*V2_ARGS, *args],
        nproc=2,
        note=note + " (shared-scripts as of a39b68fa5, TSM 2.6.0)",
        env={"SM_HP_MP_PARAMETERS": json.dumps(params)},
        deps=("psutil", "accelerate"),
        edits=list(V2_EDITS),
        success=r"FSDP training finished successfully",
        then=["--resume_from_checkpoint", "{dest}/checkpoints/gpt_neox-4steps", "--max_steps",
              "6"],
    )


SMP2_TP = _smp2(
    "smp2-tp2", {"tensor_parallel_degree": 2, "hybrid_shard_degree": 1,
                 "sm_activation_offloading": True, "activation_loading_horizon": 2},
    ["--use_smp_implementation", "1", "--max_steps", "4"],
    "SMP v2: transform (tensor parallel 2), delayed parameter init, activation offloading, "
    "sharded checkpoint every 2 steps, then a resume from step 4 to 6")
SMP2_FSDP = _smp2(
    "smp2-hybrid-shard2", {"tensor_parallel_degree": 1, "hybrid_shard_degree": 2},
    ["--use_smp_implementation", "0", "--max_steps", "4"],
    "SMP v2 without its transformer: Hugging Face model, FSDP hybrid shard 2, delayed "
    "parameter init, sharded checkpoint, then a resume")

EXAMPLES += [SMP2_TP, SMP2_FSDP]

AWSOME = "aws-samples/awsome-distributed-training"
ADT_DIR = "3.test_cases/11.modelparallel"
ADT_FILES = [f for f in V2_FILES if f not in ("train.py", "utils.py", "data_utils.py")]
ADT_SMP2 = Example(
    name="adt-smp2-tp2",
    repo=AWSOME,
    commit="bd2f524f1b0ba07fcc83b491ae9de498e6239c5f",  # the last commit before its removal
    files={f: f"{ADT_DIR}/{f}" for f in [*ADT_FILES, "train_external.py"]},
    entry="train_external.py",
    args=[
        "--model_type", "gpt_neox", "--hidden_width", "64", "--num_layers", "2",
        "--num_heads", "4", "--max_context_width", "64", "--vocab_size", "1024",
        "--train_batch_size", "2", "--val_batch_size", "2", "--epochs", "1", "--bf16", "0",
        "--use_synthetic_data", "1", "--zipped_data", "0", "--logging_freq", "1",
        "--lr_decay_iters", "10", "--delayed_param", "1", "--activation_checkpointing", "1",
        "--sharding_strategy", "hybrid_shard", "--checkpoint_dir", "{dest}/checkpoints",
        "--checkpoint_freq", "2", "--num_kept_checkpoints", "2", "--max_steps", "4",
        "--tensor_parallel_degree", "2", "--shard_degree", "1", "--offload_activations", "1",
        "--use_smp_implementation", "1", "--patch_neox_rope", "0"],
    nproc=2,
    note="SMP v2 (TSM 2.0 era, 11.modelparallel): tsm.init(dict), transform tp 2, "
         "FlashSelfAttention, delayed param init, offloading, sharded checkpoint, resume",
    deps=("psutil", "accelerate"),
    edits=[
        Edit("train_lib.py", "    device = global_rank % torch.cuda.device_count()\n",
             '    device = torch.device("cpu")\n', "device", "CUDA -> CPU"),
        Edit("train_lib.py", "    torch.cuda.set_device(device)\n", "", "device",
             "CUDA -> CPU: no device to set"),
        Edit("train_lib.py", "            device_id=torch.cuda.current_device(),\n",
             '            device_id=torch.device("cpu"),\n', "device", "CUDA -> CPU"),
        Edit("train_lib.py", "    torch.cuda.synchronize()\n", "", "device",
             "CUDA -> CPU: nothing to synchronize", count=2),
        Edit("train_lib.py", "        nvtx_warmup_iters = 3\n",
             '        nvtx_warmup_iters = float("inf")\n', "device",
             "NVTX ranges are CUDA-only: never started"),
        Edit("data/pipelines/hf_data_pipeline.py", "from datasets import load_from_disk\n",
             "load_from_disk = None\n", "dep",
             "the datasets package is not installed; only --dataset_type hf uses it"),
        *V2_EDITS[-3:],  # stdev of one rank, SMP torch's process_group=, DCP's coordinator
        Edit("checkpoints.py", '                optim_state["optimizer"], model, optimizer\n',
             '                model, optimizer, optim_state["optimizer"]\n', "torch",
             "torch >= 2.1 takes (model, optim, optim_state_dict); the script passes torch "
             "2.0's order"),
        Edit("memory_tracker.py", "rank % torch.cuda.device_count()",
             "rank % max(torch.cuda.device_count(), 1)", "device",
             "no GPU: device_count() is 0", count=2),
        Edit("memory_tracker.py", '    """Memory status gpu."""\n',
             '    """Memory status gpu."""\n    return\n', "device",
             "GPU memory report (CUDA-only) skipped; the script calls it unconditionally"),
    ],
    success=r"FSDP training finished successfully",
    then=["--resume_from_checkpoint", "{dest}/checkpoints/gpt_neox-4steps", "--max_steps", "6"],
)
EXAMPLES.append(ADT_SMP2)
