"""``modelparallel run``: torch.distributed.run (torchrun) with our defaults around it.

What this adds to torchrun: the configuration is checked before any process starts
and passed to the workers as ``MP_CONFIG``; output lines carry the global rank; a
Python warning every rank emits alike is printed once (``warnings_once``);
single-node jobs bind to loopback; and a failure ends with one summary naming the
rank that failed first, its exit code and the tail of its traceback.
"""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import sys
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.distributed import run as torchrun
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure
from torch.distributed.launcher.api import elastic_launch

import modelparallel_compat
from modelparallel import doctor
from modelparallel.config import Config, normalise
from modelparallel.config_files import read_config_file
from modelparallel.errors import ConfigError
from modelparallel.launch import warnings_once
from modelparallel.launch.lifeline import RunLifeline
from modelparallel.launch.restarts import announcing_restarts
from modelparallel.launch.run_dir import keep_run_directory
from modelparallel.launch.worker import COLLECTIVE_TIMEOUT
from modelparallel.topology import check_world

LOOPBACK = "127.0.0.1"
PREFIX = "[rank${rank}]: "


@dataclass
class RunOptions:
    script: str
    script_args: list[str] = field(default_factory=list)
    nproc_per_node: int | None = None  # default: one per GPU, else 1
    nnodes: int = 1
    node_rank: int | None = None
    rdzv_endpoint: str | None = None
    rdzv_id: str = "modelparallel"
    config: str | None = None
    max_restarts: int = 0
    log_dir: str | None = None
    local_addr: str | None = None  # this node's address for the other nodes (multi-node)
    rdzv_host: bool | None = None  # whether this node hosts the c10d rendezvous store
    compat: str | None = None  # "sagemaker": SageMaker's imports resolve to modelparallel
    run_dir: str | None = None  # default: a new dated directory under runs/ (run_dir.py)
    ranks_filter: str | None = None  # "0,2": show only these local ranks' output


def load_config_file(path: str | os.PathLike) -> tuple[dict[str, Any], Config]:
    """A configuration file on its own (``MP_CONFIG`` ignored): the keys it sets, with
    aliases resolved, and the checked Config."""
    unknown: list[tuple[str, str]] = []  # listed beside the values' problems
    explicit = normalise(read_config_file(path), origin=str(path), problems=unknown)
    try:
        config = Config.load(explicit, environ={})
    except ConfigError as e:
        raise ConfigError(unknown + e.problems) from None
    if unknown:
        raise ConfigError(unknown)
    return explicit, config


def default_nproc_per_node() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 1


def launch_config_json(path: str | None, world_size: int) -> str | None:
    """Read and check a config file for ``world_size`` ranks; the JSON for ``MP_CONFIG``."""
    if path is None:
        return None
    explicit, config = load_config_file(path)
    check_world(config, world_size)
    return json.dumps(explicit)


def torchrun_argv(opts: RunOptions, nproc: int) -> list[str]:
    """The torchrun command line equivalent to ``opts`` (the worker wrapper is added later)."""
    argv = [f"--nproc-per-node={nproc}", f"--nnodes={opts.nnodes}",
            f"--max-restarts={opts.max_restarts}", "--tee=3"]
    if opts.log_dir:
        argv.append(f"--log-dir={opts.log_dir}")
    if opts.ranks_filter:
        argv.append(f"--local-ranks-filter={opts.ranks_filter}")
    if opts.nnodes == 1 and opts.rdzv_endpoint is None:
        argv += ["--rdzv-backend=c10d", f"--rdzv-endpoint={LOOPBACK}:0",
                 f"--local-addr={LOOPBACK}"]
    elif opts.node_rank is not None:  # fixed node ranks: static rendezvous at the endpoint
        host, _, port = (opts.rdzv_endpoint or f"{LOOPBACK}:29500").rpartition(":")
        argv += ["--rdzv-backend=static", f"--master-addr={host}", f"--master-port={port}",
                 f"--node-rank={opts.node_rank}"]
    else:
        argv += ["--rdzv-backend=c10d", f"--rdzv-endpoint={opts.rdzv_endpoint}",
                 f"--rdzv-id={opts.rdzv_id}"]
        if opts.local_addr:
            argv.append(f"--local-addr={opts.local_addr}")
        if opts.rdzv_host is not None:
            argv.append(f"--rdzv-conf=is_host={str(opts.rdzv_host).lower()}")
    return [*argv, opts.script, *opts.script_args]


def run(opts: RunOptions) -> int:
    """Launch the workers, wait for them, and return the exit code for the shell."""
    return run_workers(opts)[0]


@keep_run_directory(default_nproc_per_node)  # its logs, config, metrics and report.html
def run_workers(opts: RunOptions) -> tuple[int, str | None]:
    """Launch the workers and wait for them: the exit code for the shell, and the
    failure summary (also printed) when a worker failed."""
    if not Path(opts.script).is_file():
        message = f"modelparallel run: script {opts.script!r} does not exist"
        print(message, file=sys.stderr)
        return 2, message
    if opts.nnodes > 1 and opts.rdzv_endpoint is None:
        message = (f"modelparallel run: --nnodes {opts.nnodes} needs --rdzv-endpoint "
                   f"HOST:PORT, an address of the first node that every node can reach")
        print(message, file=sys.stderr)
        return 2, message
    nproc = opts.nproc_per_node or default_nproc_per_node()
    mp_config = launch_config_json(opts.config, opts.nnodes * nproc)
    args = torchrun.parse_args(torchrun_argv(opts, nproc))

    if mp_config is not None:
        os.environ["MP_CONFIG"] = mp_config
    if opts.compat is not None:  # the workers install it (modelparallel.launch.worker)
        os.environ[modelparallel_compat.ENVIRONMENT_SWITCH] = opts.compat
    if opts.nnodes == 1 and opts.rdzv_endpoint is None:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    if opts.max_restarts > 0:
        # torch 2.13: restarting a SIGKILLed gloo group over the agent's shared store hangs
        os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    os.environ.setdefault("TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE", PREFIX)
    if nproc > 1:  # what torchrun would set, without its banner
        os.environ.setdefault("OMP_NUM_THREADS", "1")

    config, _, cmd_args = torchrun.config_from_args(args)
    # cmd_args is ["-u", script, *script_args]; run the script through our worker wrapper
    # so an uncaught error reaches the summary without the script using @record.
    entry_args = ["-u", "-m", "modelparallel.launch.worker", *cmd_args[1:]]
    # the agent's own lines ("Sending process ... closing signal", "failed (exitcode: 1)",
    # "Received 2 death signal") repeat what the summary says; each module's logger has a
    # level of its own
    for name in [*logging.root.manager.loggerDict, "torch.distributed.elastic"]:
        if name.startswith("torch.distributed.elastic"):
            logging.getLogger(name).setLevel(logging.CRITICAL)
    with tempfile.TemporaryDirectory(prefix="mp-doctor-") as doctor_dir, \
            tempfile.TemporaryDirectory(prefix="mp-warnings-") as warnings_dir:
        os.environ[doctor.FOLDER] = doctor_dir  # each rank's last call, for a postmortem
        os.environ[warnings_once.FOLDER] = warnings_dir  # a warning once, not once per rank
        if opts.ranks_filter:
            os.environ[warnings_once.RANKS] = opts.ranks_filter
        stopped_by = None
        # the lifeline ends whatever of the run is left when it ends (or the launcher dies)
        with RunLifeline(), announcing_restarts(announce_restart):
            try:
                elastic_launch(config=config, entrypoint=sys.executable)(*entry_args)
            except ChildFailedError as e:
                summary = failure_summary(e, doctor.postmortem(doctor_dir))
                print(summary, file=sys.stderr, flush=True)
                _, first = first_failure(e)
                code = exit_code(first)
                return (code if code > 0 else 128 + abs(code or 1)), summary.strip("\n=")
            except SignalException as e:  # Ctrl-C, or the launcher was stopped
                stopped_by = e.sigval
    if stopped_by is not None:
        said = f"stopped by {stopped_by.name}"
        print(f"modelparallel run: {said}{' (Ctrl-C)' if stopped_by == signal.SIGINT else ''}"
              f"; every process of the run has ended", file=sys.stderr, flush=True)
        return 128 + stopped_by, said
    return 0, None


def announce_restart(failures: Mapping[int, ProcessFailure], restart: int, of: int) -> None:
    """One line when the worker group restarts after a failure: which rank failed, how,
    and which restart this is."""
    if failures:
        rank, failure = first_failure(failures)
        error = _error_message(failure).strip().splitlines()
        site = _extra(failure, "user_site").split(": ", 1)[0]
        why = _describe_exit(exit_code(failure)) + (f", {error[0]}" if error else "") + \
            (f" at {site}" if site else "")
        what = f"rank {rank} failed ({why})"
    else:
        what = "the worker group became unhealthy"
    print(f"modelparallel run: {what}; restarting the worker group (restart {restart} of "
          f"{of})", file=sys.stderr, flush=True)


def _stopped_by_launcher(failure: ProcessFailure) -> bool:
    # torchrun's agent ends the still-running workers with SIGTERM once one has failed;
    # a rank that recorded its own error first was failing anyway
    return failure.exitcode == -signal.SIGTERM and not _recorded_error(failure)


def exit_code(failure: ProcessFailure) -> int:
    """The rank's exit code; 1 for a rank the launcher stopped while it was exiting with
    an error it had recorded (the worker wrapper exits with 1 right after)."""
    if failure.exitcode == -signal.SIGTERM and _recorded_error(failure):
        return 1
    return failure.exitcode


def _recorded_error(failure: ProcessFailure) -> bool:
    """The worker wrapper wrote this rank's error file (torchrun fills in a placeholder
    otherwise)."""
    data = failure.error_file_data
    return isinstance(data, dict) and isinstance(data.get("message"), dict)


# gloo's words when a peer process ended (nccl's: "remote process exited")
_PEER_GONE = re.compile(r"connection (closed|reset) by peer|remote process exited",
                        re.IGNORECASE)


def _error_message(failure: ProcessFailure) -> str:
    """The error line the worker wrapper recorded (``Type: text``), else torchrun's."""
    data = failure.error_file_data
    msg = data.get("message") if isinstance(data, dict) else None
    if isinstance(msg, dict) and isinstance(msg.get("message"), str):
        return msg["message"]
    if failure.exitcode is not None and failure.exitcode < 0:
        return f"the process was ended by {_describe_exit(failure.exitcode)[len('signal '):]}"
    # torchrun's placeholder ("To enable traceback see: ...") says nothing about it
    return (f"the process exited with code {failure.exitcode} without a Python error "
            f"(os._exit, or a crash in native code)")


def _reacted_to_another_rank(failure: ProcessFailure) -> bool:
    """A peer closed its connection, or a collective timed out waiting for one."""
    text = _error_message(failure)
    return bool(_PEER_GONE.search(text) or COLLECTIVE_TIMEOUT.search(text))


def first_failure(error: ChildFailedError | Mapping[int, ProcessFailure],
                  ) -> tuple[int, ProcessFailure]:
    """The rank whose failure ended the run, and that failure.

    torchrun orders failures by a timestamp in whole seconds and breaks ties by rank, so
    a rank it stopped with SIGTERM can come before the one that failed. Those are only
    chosen when every rank was stopped that way. Likewise a rank whose error only says
    that another rank went away (its connection closed, a collective timed out) comes
    after a rank that failed on its own: a rank that is SIGKILLed is often seen by the
    launcher after its peer has already raised "Connection closed by peer".
    """
    failures = error.failures if isinstance(error, ChildFailedError) else error
    return min(failures.items(),
               key=lambda item: (_stopped_by_launcher(item[1]),
                                 _reacted_to_another_rank(item[1]),
                                 exit_code(item[1]) != item[1].exitcode,  # ended by itself
                                 item[1].timestamp, item[0]))


def _extra(failure: ProcessFailure, key: str) -> str:
    """A field the worker wrapper recorded with the error (``py_callstack``, ...)."""
    data = failure.error_file_data
    msg = data.get("message") if isinstance(data, dict) else None
    extra = msg.get("extraInfo", {}) if isinstance(msg, dict) else {}
    value = extra.get(key, "") if isinstance(extra, dict) else ""
    return value if isinstance(value, str) else ""


def failure_summary(error: ChildFailedError, postmortem: str | None = None,
                    traceback_lines: int = 10, message_lines: int = 8) -> str:
    """Which rank failed first, with what, where in the user's code, what the doctor
    found (the failing rank's diagnosis, else ``postmortem``: what the ranks' last calls
    say), and what happened to the others. Ranks that failed with the same error are
    named together and the error is shown once."""
    rank, first = first_failure(error)
    message = _error_message(first).strip()
    same = sorted(r for r, f in error.failures.items()
                  if not _stopped_by_launcher(f) and _error_message(f).strip() == message)
    lines = ["", "=" * 72,
             f"modelparallel run: rank {rank} (local rank {first.local_rank}) failed first "
             f"with {_describe_exit(exit_code(first))}"]
    if len(same) > 1:
        lines.append(f"  the same error on rank(s) {', '.join(map(str, same))}")
    diagnosis = _extra(first, "diagnosis") or postmortem
    if diagnosis:
        lines += [f"  {line}" for line in diagnosis.splitlines()]
    if message and not message.startswith("DoctorVerdict"):  # the diagnosis says it
        shown = message.splitlines()
        cut = len(shown) > message_lines
        lines += [f"  {'error: ' if i == 0 else '  '}{line}"
                  for i, line in enumerate(shown[:message_lines])]
        if cut:
            lines.append("    ...")
    user_site = _extra(first, "user_site")
    if user_site:
        lines.append(f"  in your code: {user_site}")
    callstack = _extra(first, "py_callstack")
    if callstack and not diagnosis and not user_site:
        tail = callstack.rstrip().splitlines()[-traceback_lines:]
        lines += ["  traceback (last lines):", *(f"    {line}" for line in tail)]
    others = sorted(r for r in error.failures if r != rank and r not in same)
    failed = [r for r in others if not _stopped_by_launcher(error.failures[r])]
    stopped = [r for r in others if _stopped_by_launcher(error.failures[r])]
    if failed:
        lines.append(f"  also failed: rank(s) {', '.join(map(str, failed))}")
    if stopped:
        lines.append(f"  stopped by the launcher: rank(s) {', '.join(map(str, stopped))}")
    if callstack and (diagnosis or user_site) and first.error_file and \
            Path(first.error_file).is_file():
        lines.append(f"  full traceback: {first.error_file}")
    lines.append("=" * 72)
    return "\n".join(lines)


def _describe_exit(code: int) -> str:
    if code is not None and code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"exit code {code}"
