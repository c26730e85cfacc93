"""The SMP v2 scripts of examples_catalog: AWS's shared-scripts (tensor parallel, hybrid
shard, context parallel) and awsome-distributed-training's 11.modelparallel."""

from __future__ import annotations

import json

from examples_catalog import HEAD, SAGEMAKER_EXAMPLES, V2_DIR, Edit, Example, OneProcess

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
# the edits every SMP v2 script of these repositories needs on a CPU machine
CPU_EDITS = [
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
]
V2_EDITS = [
    Edit("train_lib.py",
         "import transformer_engine\nfrom transformer_engine.common.recipe import Format, "
         "DelayedScaling\n", "", "nvidia", "TransformerEngine (FP8) removed; run with --fp8 0"),
    *CPU_EDITS[:-1],
    Edit("train_utils.py", 'attn_implementation="flash_attention_2"',
         'attn_implementation="sdpa"', "nvidia",
         "FlashAttention-2 is CUDA-only: PyTorch's SDPA instead", count=2),
    CPU_EDITS[-1],
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


def _smp2(name: str, params: dict, args: list[str], note: str, **more) -> Example:
    return Example(**{
        "name": name, "repo": SAGEMAKER_EXAMPLES, "commit": HEAD,
        "files": {f: f"{V2_DIR}/{f}" for f in V2_FILES}, "entry": "train.py",
        "args": [*V2_ARGS, *args], "nproc": 2,
        "note": note + " (shared-scripts as of a39b68fa5, TSM 2.6.0)",
        "env": {"SM_HP_MP_PARAMETERS": json.dumps(params)}, "deps": ("psutil", "accelerate"),
        "edits": list(V2_EDITS), "success": r"FSDP training finished successfully",
        "then": ["--resume_from_checkpoint", "{dest}/checkpoints/gpt_neox-4steps",
                 "--max_steps", "6"],
        **more})


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


def _smp2_cp(comm_type: str) -> Example:
    """Context parallel 2 inside hybrid shard 2 on 4 ranks (SMP's cp <= hybrid_shard_degree):
    Llama, SMP's implementation (with --use_smp_implementation 0 the script resets cp to 1).
    Each rank takes 2 of the 2 * cp chunks of every 32-token sequence; the script asserts
    16 tokens (max_context_width // cp). The dummy data ignores the data-parallel rank (every
    rank draws the same samples from the same seed), so one process with the same
    --train_batch_size sees the same global batch: its batch-0 loss and gradient norm are
    the figures compared (--compare-one-process). The reduced loss (all-reduced over the
    world, divided by it) is the whole sequences' mean: each cp rank's loss is its share
    times cp."""
    return _smp2(
        f"smp2-cp2-{comm_type.replace('_', '-')}",
        {"context_parallel_degree": 2, "hybrid_shard_degree": 2},
        ["--model_type", "llama_v2", "--llama_intermediate_size", "128",
         "--max_context_width", "32", "--use_smp_implementation", "1",
         "--cp_comm_type", comm_type, "--log_reduced_training_loss", "1", "--max_steps", "3"],
        f"SMP v2 Llama, context parallel 2 (cp_comm_type={comm_type}) x hybrid shard 2 on 4 "
        "ranks, delayed parameter init, activation checkpointing, a sharded checkpoint",
        nproc=4, then=None,
        edits=[*V2_EDITS, Edit(
            "logging_utils.py", "gradnorm: %.4f", "gradnorm: %.9g", "log",
            "the gradient norm to 9 digits, not 4 decimals: compared with one process's")],
        # the script's own record of cp: its global batch in tokens, world x 32 x 2 / cp
        success=r"Global batch size in tokens:\s+128 [\s\S]*FSDP training finished successfully",
        one_process=OneProcess(
            env={"SM_HP_MP_PARAMETERS": json.dumps({"hybrid_shard_degree": 1})},
            figures=r"Batch 0 Loss: (?P<loss>\S+), .*gradnorm: (?P<grad_norm>\S+)"))


SMP2_CP = [_smp2_cp("p2p"), _smp2_cp("all_gather")]

# Mixtral in the scripts' MoE mode (SMP's own MoE layer: --use_smp_implementation 1 builds
# MoEConfig(smp_moe=True)), experts split over 2 ranks, each expert replicated over 2
# (hybrid shard 2) on 4 ranks. The dummy data ignores the data-parallel rank, so one process
# with the same --train_batch_size sees the same global batch: batch 0's loss and gradient
# norm are compared (--compare-one-process). --moe_load_balancing aux_loss: the script's
# default, sinkhorn, balances each rank's own token set, which differs from one process's.
SMP2_MOE = _smp2(
    "smp2-moe-ep2", {"expert_parallel_degree": 2, "hybrid_shard_degree": 2},
    ["--model_type", "mixtral", "--intermediate_size", "128", "--num_key_value_heads", "2",
     "--num_local_experts", "4", "--num_experts_per_tok", "2", "--moe", "1",
     "--moe_load_balancing", "aux_loss", "--use_smp_implementation", "1",
     "--max_steps", "4"],
    "SMP v2 Mixtral, SMP's MoE layer (aux_loss), expert parallel 2 x hybrid shard 2 on 4 "
    "ranks, delayed parameter init, activation checkpointing, a sharded checkpoint, then a "
    "resume",
    nproc=4,
    then=["--resume_from_checkpoint", "{dest}/checkpoints/mixtral-4steps", "--max_steps", "6"],
    # the launcher's line: the layout the run took (the script logs no expert-parallel size)
    success=r"expert_parallel_degree: 1 -> 2[\s\S]*?FSDP training finished successfully",
    edits=[*V2_EDITS, Edit(
        "logging_utils.py", "gradnorm: %.4f", "gradnorm: %.9g", "log",
        "the gradient norm to 9 digits, not 4 decimals: compared with one process's"),
        *[Edit("checkpoints.py",
               f"        if expert_parallel_degree > 1:\n            {d} = os.path.join(\n"
               f"                {d}, f\"ep{{expert_parallel_degree}}-{{state.ep_rank}}\"\n"
               f"            )\n", "", "world",
               "one sharded checkpoint for every expert-parallel rank: SMP's FSDP process "
               "group holds one expert-parallel rank (a directory each), ours all of them "
               "(the experts are saved at their global index, docs/expert-parallel.md)",
               count=2) for d in ("save_dir", "checkpoint_dir")]],
    one_process=OneProcess(
        env={"SM_HP_MP_PARAMETERS": json.dumps({"hybrid_shard_degree": 1})},
        figures=r"Batch 0 Loss: (?P<loss>\S+), .*gradnorm: (?P<grad_norm>\S+)"))

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
        *CPU_EDITS,
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
SMP2_EXAMPLES: list[Example] = [SMP2_TP, SMP2_FSDP, *SMP2_CP, SMP2_MOE, ADT_SMP2]
