"""SLURM: one ``sbatch`` job, one instance per node started by ``srun``.

The batch script finds every node's address (``scontrol show node``), numbers the
instances in the string order of their addresses (the order torchrun's c10d rendezvous
gives the nodes), and runs the instance command on each node with the rendezvous on
the first address. The runner follows the job with ``scontrol show job`` and its log
through the job's output file; ``stop`` is ``scancel``. The jobs directory must be on
the cluster's shared filesystem.
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import time
from typing import Any

from modelparallel.jobs.backends.base import Backend, JobContext
from modelparallel.jobs.follow import FollowedFile

ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
         "PREEMPTED", "BOOT_FAIL", "DEADLINE")
STATE_POLL_S = 1.0


class SlurmBackend(Backend):
    name = "slurm"
    options_doc = {
        "partition": "the partition to submit to (default: the cluster's default)",
        "account": "the account to charge",
        "rdzv_port": "the rendezvous port on the first node (default 20000 + job id % 10000)",
        "sbatch_args": "more sbatch options, a list such as ['--gres=gpu:8']",
        "python": "the Python on the nodes (default: the one submitting)",
    }

    def __init__(self, options: dict[str, Any]):
        super().__init__(options)
        self.job_id: str | None = None
        self.output: FollowedFile | None = None
        self.state = "PENDING"
        self.last_state_check = 0.0
        self.instances = 0

    @classmethod
    def missing_tools(cls) -> list[tuple[str, str]]:
        return [("backend", f"the slurm backend needs `{tool}` on PATH (SLURM's client "
                            f"commands)")
                for tool in ("sbatch", "scontrol", "scancel") if shutil.which(tool) is None]

    @classmethod
    def check(cls, spec) -> list[tuple[str, str]]:
        problems = super().check(spec)
        args = spec.backend_options.get("sbatch_args", [])
        if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
            problems.append(("backend_options.sbatch_args", "expected a list of strings"))
        return problems

    def render(self, job: JobContext) -> str:
        """The batch script."""
        spec = job.spec
        opts = self.options
        lines = ["#!/bin/bash", f"#SBATCH --job-name={spec.name}",
                 f"#SBATCH --nodes={spec.instance_count}", "#SBATCH --ntasks-per-node=1",
                 f"#SBATCH --output={job.layout.root}/slurm-%j.out",
                 f"#SBATCH --chdir={job.layout.root}"]
        if opts.get("partition"):
            lines.append(f"#SBATCH --partition={opts['partition']}")
        if opts.get("account"):
            lines.append(f"#SBATCH --account={opts['account']}")
        if spec.max_run:
            minutes = max(1, -(-int(spec.max_run) // 60))
            lines.append(f"#SBATCH --time={minutes}")
        lines += [f"#SBATCH {a}" for a in opts.get("sbatch_args", [])]
        python = opts.get("python", job.python)
        # below the kernel's range for outgoing connections (32768-60999 by default)
        port = opts.get("rdzv_port") or "$((20000 + SLURM_JOB_ID % 10000))"
        command = " ".join(shlex.quote(a) for a in [python, "-m", "modelparallel.jobs.instance",
                                                   str(job.layout.root)])
        lines += [
            "set -euo pipefail",
            "# each node's address; instances are numbered in the (bytewise) order of their",
            "# addresses, the order in which torchrun's c10d rendezvous numbers nodes",
            "addr_of() { scontrol show node \"$1\" | tr ' ' '\\n' | sed -n 's/^NodeAddr=//p'; }",
            "export -f addr_of",
            "export MP_ADDRS=$(for n in $(scontrol show hostnames \"$SLURM_JOB_NODELIST\"); "
            "do addr_of \"$n\"; done | LC_ALL=C sort | tr '\\n' ' ')",
            "head=${MP_ADDRS%% *}",
            f"export MP_RDZV_ENDPOINT=$head:{port}",
            "echo \"[modelparallel] slurm job $SLURM_JOB_ID on $SLURM_JOB_NODELIST "
            "($MP_ADDRS), rendezvous $MP_RDZV_ENDPOINT\"",
            "srun --kill-on-bad-exit=1 --ntasks-per-node=1 bash -c '",
            "  set -o pipefail",
            "  me=$(addr_of \"$SLURMD_NODENAME\")",
            "  index=0; for a in $MP_ADDRS; do [ \"$a\" = \"$me\" ] && break; "
            "index=$((index + 1)); done",
            f"  {command} --index $index --rdzv-endpoint $MP_RDZV_ENDPOINT "
            f"--local-addr $me --rdzv-id {shlex.quote(job.rdzv_id)} 2>&1 "
            "| sed -u \"s/^/[algo-$((index + 1))] /\"'",
        ]
        return "\n".join(lines) + "\n"

    def start(self, job: JobContext) -> None:
        self.instances = job.spec.instance_count
        script = job.layout.root / "sbatch.sh"
        script.write_text(self.render(job))
        done = subprocess.run(["sbatch", "--parsable", str(script)], capture_output=True,
                              text=True, timeout=60)
        if done.returncode != 0:
            raise RuntimeError(f"sbatch failed ({done.returncode}): {done.stderr.strip()}")
        self.job_id = done.stdout.strip().split(";")[0]
        self.output = FollowedFile(job.layout.root / f"slurm-{self.job_id}.out")

    def info(self) -> dict[str, Any]:
        return {"slurm_job_id": self.job_id}

    def _check_state(self) -> None:
        now = time.monotonic()
        if now - self.last_state_check < STATE_POLL_S or self.state in ENDED:
            return
        self.last_state_check = now
        assert self.job_id is not None  # set by start()
        done = subprocess.run(["scontrol", "show", "job", "-o", self.job_id],
                              capture_output=True, text=True, timeout=60)
        match = re.search(r"JobState=(\S+)", done.stdout)
        if match:
            self.state = match.group(1)
        elif "Invalid job id" in done.stderr:  # long gone from the controller
            self.state = "COMPLETED"

    def poll(self) -> tuple[list[tuple[int, str]], bool]:
        self._check_state()
        ended = self.state in ENDED
        data = self.output.read_new(to_end=ended) if self.output is not None else b""
        return [(-1, raw.decode(errors="replace")) for raw in data.splitlines()], ended

    def exit_codes(self) -> dict[int, int | None]:
        # each instance's own code is in its result.json; the runner reads those
        return {}

    def stop(self) -> None:
        if self.job_id is None:
            return
        subprocess.run(["scancel", self.job_id], capture_output=True, timeout=60)
        deadline = time.monotonic() + 60
        while self.state not in ENDED and time.monotonic() < deadline:
            self.last_state_check = 0.0
            self._check_state()
            time.sleep(0.5)
