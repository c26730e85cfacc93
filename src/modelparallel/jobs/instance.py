"""One instance of a job: ``python -m modelparallel.jobs.instance JOB_DIR --index I ...``.

Every backend runs this once per instance (a subprocess, a Ray actor's child, an
``srun`` task, a Kubernetes pod). It prepares the instance's directories and
channels, exports the job contract's environment (MP_* and SageMaker's SM_* names),
runs the entry point under ``torch.distributed.run`` joined to the other instances by
a c10d rendezvous, and at the end writes ``result.json`` (exit code, failure reason)
and, on the first instance, the model and output archives.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import traceback
from pathlib import Path
from typing import Any

from torch.distributed.elastic.multiprocessing.api import SignalException

import modelparallel_compat
from modelparallel.jobs import artifacts
from modelparallel.jobs.channels import materialize
from modelparallel.jobs.layout import JobLayout
from modelparallel.jobs.spec import JobSpec
from modelparallel.launch.lifeline import follow_parent
from modelparallel.launch.run import RunOptions, run_workers

FAILURE_LINES = 25  # of a failure file or the launcher's summary, kept as the reason


def hyperparameter_args(hps: dict[str, Any]) -> list[str]:
    """``--key value`` for each hyperparameter, sorted by key (strings as they are,
    everything else as JSON)."""
    args = []
    for key in sorted(hps):
        value = hps[key]
        args += [f"--{key}", value if isinstance(value, str) else json.dumps(value)]
    return args


def worker_environment(spec: JobSpec, index: int, channels: dict[str, str],
                       layout: JobLayout, code_dir: Path) -> dict[str, str]:
    """The job contract (docs/jobs.md): the MP_* variables and the SM_* names scripts read."""
    inst = layout.instance(index)
    hosts = spec.hosts
    hps = json.dumps(spec.hyperparameters, sort_keys=True)
    paths = {"MODEL_DIR": inst / "model", "OUTPUT_DIR": inst / "output",
             "OUTPUT_DATA_DIR": inst / "output" / "data", "INPUT_DIR": inst / "input",
             "INPUT_DATA_DIR": inst / "input" / "data"}
    env = {"MP_JOB_NAME": spec.name, "MP_HOSTS": json.dumps(hosts),
           "MP_INSTANCE_INDEX": str(index),
           "MP_CURRENT_HOST": hosts[index], "MP_NUM_PROCESSES": str(spec.world_size),
           "MP_PROCESSES_PER_HOST": str(spec.processes_per_host), "MP_HPS": hps,
           "MP_CHECKPOINT_DIR": str(layout.checkpoints),
           "MP_METRICS_FILE": str(layout.metrics(index))}
    if spec.config:
        env["MP_CONFIG"] = json.dumps(spec.config)
    if spec.distribution and "smdistributed" in spec.distribution:
        # a SageMaker script: its smdistributed / torch.sagemaker imports resolve to
        # modelparallel (the job's own environment may still set it to "")
        env[modelparallel_compat.ENVIRONMENT_SWITCH] = "sagemaker"
    sm = {"SM_HOSTS": json.dumps(hosts), "SM_CURRENT_HOST": hosts[index],
          "SM_HPS": hps, "SM_CHANNELS": json.dumps(sorted(channels)),
          "SM_USER_ENTRY_POINT": Path(spec.entry_point).name, "SM_MODULE_DIR": str(code_dir),
          "SM_USER_ARGS": json.dumps(hyperparameter_args(spec.hyperparameters)),
          "SM_NUM_CPUS": str(os.cpu_count() or 1), "SM_NUM_GPUS": str(_gpus()),
          "SM_NETWORK_INTERFACE_NAME": os.environ.get("GLOO_SOCKET_IFNAME", "lo"),
          "SM_CURRENT_INSTANCE_GROUP": "homogeneousCluster"}
    for key, path in paths.items():
        env[f"MP_{key}"] = env[f"SM_{key}"] = str(path)
    for name, where in channels.items():
        env[f"MP_CHANNEL_{name.upper()}"] = env[f"SM_CHANNEL_{name.upper()}"] = where
        channel = spec.inputs[name]
        env[f"MP_CHANNEL_{name.upper()}_URI"] = channel.uri
        if channel.content_type:
            env[f"MP_CHANNEL_{name.upper()}_CONTENT_TYPE"] = channel.content_type
    for key, value in spec.hyperparameters.items():
        env[f"SM_HP_{key.upper().replace('-', '_')}"] = (
            value if isinstance(value, str) else json.dumps(value))
    env.update(sm)
    env.update(spec.environment)  # the user's own variables win
    return env


def _gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def prepare(spec: JobSpec, layout: JobLayout, index: int) -> tuple[Path, dict[str, str]]:
    """A fresh instance directory with the code and channels; (code dir, channels)."""
    inst = layout.instance(index)
    for sub in ("code", "input", "model", "output", "run"):  # run: this attempt's run dir
        shutil.rmtree(inst / sub, ignore_errors=True)
    (inst / "result.json").unlink(missing_ok=True)
    code = inst / "code"
    shutil.copytree(layout.code, code)
    for sub in ("model", "output/data", "input/data"):
        (inst / sub).mkdir(parents=True, exist_ok=True)
    layout.checkpoints.mkdir(parents=True, exist_ok=True)
    channels = {}
    for name, channel in spec.inputs.items():
        channels[name] = materialize(channel, inst / "input" / "data" / name, index,
                                     spec.instance_count)
    return code, channels


def failure_reason(layout: JobLayout, index: int, summary: str | None) -> str | None:
    """The script's own ``MP_OUTPUT_DIR/failure`` file if it wrote one, else the
    launcher's summary (first failing rank, its error and traceback tail)."""
    failure = layout.instance(index) / "output" / "failure"
    text = failure.read_text(errors="replace") if failure.is_file() else summary
    if not text or not text.strip():
        return None
    return "\n".join(text.strip().splitlines()[:FAILURE_LINES])


def upload_artifacts(spec: JobSpec, layout: JobLayout, index: int, succeeded: bool,
                     ) -> dict[str, str]:
    """Pack and upload model.tar.gz (after success) and output.tar.gz; their URIs."""
    inst = layout.instance(index)
    dest = artifacts.join(spec.output_path, spec.name, "output")
    uris = {}
    archives = [("output_uri", inst / "output" / "data", "output.tar.gz")]
    if succeeded:
        archives.insert(0, ("model_uri", inst / "model", "model.tar.gz"))
    for key, directory, name in archives:
        archive = inst / name
        artifacts.pack(directory, archive)
        uri = artifacts.join(dest, name)
        artifacts.upload(archive, uri)
        archive.unlink()
        uris[key] = uri
    return uris


def run_instance(layout: JobLayout, index: int, rdzv_endpoint: str, local_addr: str,
                 rdzv_id: str) -> int:
    spec = JobSpec.from_json(layout.spec.read_text())
    host = spec.hosts[index]
    print(f"[modelparallel] {host}: preparing code and channels", flush=True)
    code, channels = prepare(spec, layout, index)
    for name, where in channels.items():
        print(f"[modelparallel] {host}: channel {name} -> {where}", flush=True)
    os.environ.update(worker_environment(spec, index, channels, layout, code))
    if local_addr.startswith("127."):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    config_file = None
    if spec.config:
        config_file = layout.instance(index) / "config.json"
        config_file.write_text(json.dumps(spec.config))
    os.chdir(code)
    print(f"[modelparallel] {host}: starting {spec.processes_per_host} process(es), "
          f"rendezvous {rdzv_endpoint} ({spec.instance_count} instance(s))", flush=True)
    try:
        code_, summary = run_workers(RunOptions(
            script=str(code / spec.entry_point),
            script_args=hyperparameter_args(spec.hyperparameters),
            nproc_per_node=spec.processes_per_host, nnodes=spec.instance_count,
            rdzv_endpoint=rdzv_endpoint, rdzv_id=rdzv_id,
            config=str(config_file) if config_file else None,
            max_restarts=spec.max_restarts, local_addr=local_addr,
            run_dir=str(layout.run_dir(index)),
            # the first instance hosts the store: a failed bind is an error at once,
            # not two clients waiting for a store nobody hosts
            rdzv_host=index == 0))
    except SignalException as e:  # stopped: torchrun ended the workers, record that
        code_, summary = 128 + e.sigval, f"stopped by {e.sigval.name}"
    result: dict[str, Any] = {"index": index, "host": host, "exit_code": code_,
                              "failure_reason": failure_reason(layout, index, summary)
                              if code_ else None}
    if index == 0:
        try:
            result.update(upload_artifacts(spec, layout, index, code_ == 0))
        except Exception as e:  # the job's outcome is still recorded
            result["upload_error"] = f"{type(e).__name__}: {e}"
            print(f"[modelparallel] {host}: uploading artifacts failed: {e}", flush=True)
            code_ = code_ or 1
            result["exit_code"] = code_
            result["failure_reason"] = result["failure_reason"] or (
                f"uploading artifacts to {spec.output_path} failed: {e}")
    write_result(layout, index, result)
    print(f"[modelparallel] {host}: finished with exit code {code_}", flush=True)
    return code_


def write_result(layout: JobLayout, index: int, result: dict[str, Any]) -> None:
    tmp = layout.result(index).with_suffix(".partial")
    tmp.parent.mkdir(parents=True, exist_ok=True)
    tmp.write_text(json.dumps(result))
    os.replace(tmp, layout.result(index))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m modelparallel.jobs.instance")
    p.add_argument("job_dir")
    p.add_argument("--index", type=int, required=True, help="instance index, 0-based")
    p.add_argument("--rdzv-endpoint", required=True, help="HOST:PORT on the first instance")
    p.add_argument("--local-addr", default="127.0.0.1", help="this instance's address")
    p.add_argument("--rdzv-id", required=True)
    args = p.parse_args(argv)
    # torchrun's agent stops its workers on SIGTERM (and they follow it if it is killed)
    follow_parent(signal.SIGTERM, kill_after_s=15)
    layout = JobLayout(args.job_dir)
    try:
        code = run_instance(layout, args.index, args.rdzv_endpoint, args.local_addr,
                            args.rdzv_id)
    except Exception as e:  # setting up failed (a channel could not be copied, ...)
        traceback.print_exc()
        write_result(layout, args.index, {
            "index": args.index, "exit_code": 1,
            "failure_reason": f"preparing instance {args.index + 1} failed: "
                              f"{type(e).__name__}: {e}"})
        code = 1
    sys.exit(code)


if __name__ == "__main__":
    main()
