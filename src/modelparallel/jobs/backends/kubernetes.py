"""Kubernetes: the job as a Kubeflow training-operator ``PyTorchJob``.

One pod per instance: ``Master`` (instance 0) and ``Worker`` replicas (instances 1..N-1),
each running the instance command in the ``pytorch`` container. The operator sets, in
every pod, ``RANK`` (the replica's node rank: Master 0, Worker ``i`` -> ``i + 1``),
``MASTER_ADDR`` (the Master's service, ``NAME-master-0``) and ``MASTER_PORT``; Kubernetes
expands ``$(VAR)`` in the command, so the manifest passes ``--index $(RANK)
--rdzv-endpoint $(MASTER_ADDR):$(MASTER_PORT)``.

The job directory must be at the same path in every pod and on the machine that runs
the job's runner: ``volume_claim`` mounts a PersistentVolumeClaim holding the jobs
directory there. The operator restarts nothing (``restartPolicy: Never``);
``max_restarts`` is torchrun's, inside the instance command.
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
import queue
import re
import subprocess
import threading
import time
from typing import Any

import yaml

from modelparallel.jobs.backends.base import Backend, JobContext, drain
from modelparallel.jobs.spec import JobSpec

CONTAINER = "pytorch"  # the container name the operator looks for
PORT = 23456  # the operator's default for the port named pytorchjob-port: MASTER_PORT
CHECK_S = 2.0  # how often poll() asks the cluster
LOG_GRACE_S = 30.0  # once the pods ended, how long their log streams may still run
KUBECTL_FAILING_S = 300.0  # kubectl failing this long in a row ends the job with an error
# the local addresses are the pod names, which sort in instance order up to NAME-worker-9
MAX_INSTANCES = 11
DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")
ENV_NAME = re.compile(r"^[-._a-zA-Z][-._a-zA-Z0-9]*$")
KLOG_LINE = re.compile(r"^[IWEF]\d{4} \d\d:\d\d:\d\d")
MANAGED_BY = {"app.kubernetes.io/managed-by": "modelparallel"}
JOB_LABEL = "modelparallel/job"
# labels the operator puts on its pods
OPERATOR_JOB = "training.kubeflow.org/job-name"
OPERATOR_TYPE = "training.kubeflow.org/replica-type"
OPERATOR_INDEX = "training.kubeflow.org/replica-index"


class KubernetesBackend(Backend):
    name = "kubernetes"
    options_doc = {
        "image": "container image with modelparallel and the script's dependencies (required)",
        "namespace": "namespace of the PyTorchJob (default)",
        "volume_claim": "PersistentVolumeClaim holding the jobs directory, mounted at its "
                        "path in every pod",
        "service_account": "service account of the pods",
        "resources": "the container's resources, e.g. {limits: {nvidia.com/gpu: 8}}",
        "labels": "extra labels for the PyTorchJob and its pods",
        "python": "the interpreter in the image (python)",
        "kubectl": "the kubectl command (kubectl)",
    }

    def __init__(self, options):
        super().__init__(options)
        self.namespace = str(self.options.get("namespace", "default"))
        self.kubectl = str(self.options.get("kubectl", "kubectl"))
        self.job_name = ""
        self.created = False
        self.lines: queue.Queue[tuple[int, str]] = queue.Queue()
        self.followers: dict[str, tuple[subprocess.Popen, threading.Thread]] = {}
        self.codes: dict[int, int | None] = {}
        self.phases: dict[str, str] = {}
        self.last_check = -math.inf
        self.failing_since: float | None = None
        self.ended_at: float | None = None

    # -- the manifest ------------------------------------------------------------------

    @classmethod
    def check(cls, spec: JobSpec) -> list[tuple[str, str]]:
        problems = super().check(spec)
        opts = spec.backend_options

        def bad(key: str, message: str) -> None:
            problems.append((f"backend_options.{key}", message))

        image = opts.get("image")
        if not isinstance(image, str) or not image.strip():
            bad("image", "is required: a container image with modelparallel and the "
                         "training script's dependencies installed")
        for key, pattern, most in (("namespace", DNS_LABEL, 63),
                                   ("volume_claim", DNS_SUBDOMAIN, 253),
                                   ("service_account", DNS_SUBDOMAIN, 253)):
            value = opts.get(key)
            if value is not None and not (isinstance(value, str) and pattern.match(value)
                                          and len(value) <= most):
                bad(key, f"{value!r} is not a Kubernetes name (lowercase letters, digits "
                         f"and hyphens)")
        for key in ("python", "kubectl"):
            if key in opts and (not isinstance(opts[key], str) or not opts[key]):
                bad(key, "expected a command name or path")
        resources = opts.get("resources")
        if resources is not None and not (isinstance(resources, dict) and all(
                k in ("limits", "requests", "claims")
                and isinstance(v, list if k == "claims" else dict)
                for k, v in resources.items())):
            bad("resources", "expected {limits: {...}, requests: {...}} (a container's "
                             "resources)")
            resources = None
        gpus = ((resources or {}).get("limits") or {}).get("nvidia.com/gpu")
        gpus = int(gpus) if isinstance(gpus, str) and gpus.isdigit() else gpus
        if isinstance(gpus, int) and 0 < gpus < spec.processes_per_host:
            problems.append(("processes_per_host",
                             f"{spec.processes_per_host} processes per pod but "
                             f"backend_options.resources gives each pod {gpus} GPU(s); "
                             f"set processes_per_host: {gpus}"))
        for key in spec.environment:
            if key == "POD_NAME" or not ENV_NAME.match(key):
                problems.append((f"environment.{key}", "the kubernetes backend sets POD_NAME"
                                 if key == "POD_NAME" else "is not a Kubernetes environment "
                                                           "variable name"))
        labels = opts.get("labels")
        if labels is not None and not (isinstance(labels, dict) and all(
                isinstance(k, str) and isinstance(v, str) for k, v in labels.items())):
            bad("labels", "expected a mapping of strings to strings")
        if spec.instance_count > MAX_INSTANCES:
            problems.append(("instance_count", f"{spec.instance_count} is more than the "
                                               f"kubernetes backend's {MAX_INSTANCES}: the "
                                               f"pods' names (NAME-worker-10 before "
                                               f"NAME-worker-2) would not sort in instance "
                                               f"order, which torchrun's rendezvous needs"))
        # the operator names pods and services NAME-master-0, NAME-worker-I: DNS-1035 labels
        last = (f"{spec.name}-worker-{spec.instance_count - 2}" if spec.instance_count > 1
                else f"{spec.name}-master-0")
        if not (spec.name[:1].isalpha() and DNS_LABEL.match(spec.name)) or len(last) > 63:
            problems.append(("job_name", f"{spec.name!r} cannot name a PyTorchJob: use "
                                         f"lowercase letters, digits and hyphens, starting "
                                         f"with a letter, short enough that its last pod's "
                                         f"name {last!r} has at most 63 characters"))
        return problems

    def manifest(self, job: JobContext) -> dict[str, Any]:
        """The PyTorchJob for ``job``."""
        spec = job.spec
        # The local address is the pod's name, which is also its service's name
        # (NAME-master-0, NAME-worker-I): torchrun's c10d rendezvous numbers nodes in the
        # order of their addresses, and the Master's name sorts before every Worker's, so
        # instance 0 holds global rank 0 (pod IPs would sort in no useful order).
        variables = ("$(RANK)", "$(MASTER_ADDR):$(MASTER_PORT)", "$(POD_NAME)")
        in_pod = JobContext(spec, job.layout, job.attempt,
                            python=str(self.options.get("python", "python")))
        command = [arg if arg in variables else arg.replace("$(", "$$(")  # literal $(
                   for arg in in_pod.command(*variables)]
        labels = {**self.options.get("labels", {}), **MANAGED_BY, JOB_LABEL: spec.name}
        env = [{"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}]
        env += [{"name": k, "value": v} for k, v in spec.environment.items()]
        mounts = [{"name": "dshm", "mountPath": "/dev/shm"}]  # NCCL, DataLoader workers
        volumes: list[dict[str, Any]] = [{"name": "dshm", "emptyDir": {"medium": "Memory"}}]
        if self.options.get("volume_claim"):
            volumes.append({"name": "jobs", "persistentVolumeClaim": {
                "claimName": self.options["volume_claim"]}})
            mounts.append({"name": "jobs", "mountPath": str(job.layout.root.parent)})
        container: dict[str, Any] = {
            "name": CONTAINER, "image": self.options.get("image"), "command": command,
            "env": env, "ports": [{"name": "pytorchjob-port", "containerPort": PORT}],
            "volumeMounts": mounts}
        if self.options.get("resources"):
            container["resources"] = self.options["resources"]
        pod_spec: dict[str, Any] = {"containers": [container], "volumes": volumes}
        if self.options.get("service_account"):
            pod_spec["serviceAccountName"] = self.options["service_account"]

        def replicas(count: int) -> dict[str, Any]:
            return {"replicas": count, "restartPolicy": "Never",
                    "template": {"metadata": {"labels": dict(labels)},
                                 "spec": copy.deepcopy(pod_spec)}}

        specs = {"Master": replicas(1)}
        if spec.instance_count > 1:
            specs["Worker"] = replicas(spec.instance_count - 1)
        # cleanPodPolicy None: ended pods stay (their logs, exit codes) until the job is
        # deleted; stop() deletes it, and with it any pod still running
        run_policy: dict[str, Any] = {"cleanPodPolicy": "None", "backoffLimit": 0}
        if spec.max_run:
            run_policy["activeDeadlineSeconds"] = math.ceil(spec.max_run)
        return {"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob",
                "metadata": {"name": spec.name, "namespace": self.namespace,
                             "labels": dict(labels)},
                "spec": {"runPolicy": run_policy, "pytorchReplicaSpecs": specs}}

    def render(self, job: JobContext) -> str:
        return yaml.safe_dump(self.manifest(job), sort_keys=False)

    # -- running -----------------------------------------------------------------------

    def _kubectl(self, *args: str, stdin: str | None = None,
                 timeout: float = 60) -> subprocess.CompletedProcess:
        try:
            return subprocess.run([self.kubectl, *args, "-n", self.namespace], input=stdin,
                                  capture_output=True, text=True, timeout=timeout)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise RuntimeError(f"{self.kubectl} {args[0]} failed: {e}") from None

    def _failed(self, what: str, proc: subprocess.CompletedProcess) -> RuntimeError:
        lines = proc.stderr.strip().splitlines()
        # kubectl's own message, without client-go's repeated log lines (E1121 12:00 ...)
        err = "\n".join(x for x in lines if not KLOG_LINE.match(x)) or "\n".join(lines[-1:])
        hint = (" (is the Kubeflow training operator installed?)"
                if "no matches for kind" in err or "resource type" in err else "")
        return RuntimeError(f"kubectl failed to {what} PyTorchJob {self.job_name} in "
                            f"namespace {self.namespace}{hint}: {err}")

    def start(self, job: JobContext) -> None:
        self.job_name = job.spec.name
        self.codes = dict.fromkeys(range(job.spec.instance_count))
        # an earlier attempt's PyTorchJob and pods (ours only: chosen by our labels)
        proc = self._kubectl("delete", "pytorchjob", "-l", ",".join(
            f"{k}={v}" for k, v in {**MANAGED_BY, JOB_LABEL: self.job_name}.items()),
            "--ignore-not-found", "--cascade=foreground", "--wait=true", "--timeout=300s",
            timeout=330)
        if proc.returncode != 0:
            raise self._failed("clean up an earlier attempt's", proc)
        proc = self._kubectl("create", "-f", "-", stdin=json.dumps(self.manifest(job)))
        if proc.returncode != 0:
            raise self._failed("create", proc)
        self.created = True
        self.lines.put((-1, f"[modelparallel] created PyTorchJob {self.job_name} in "
                            f"namespace {self.namespace}"))

    def poll(self) -> tuple[list[tuple[int, str]], bool]:
        now = time.monotonic()
        if self.ended_at is None and now - self.last_check >= CHECK_S:
            self.last_check = now
            self._check(now)
        streaming = [p for p, reader in self.followers.values() if reader.is_alive()]
        if self.ended_at is not None and streaming and now - self.ended_at > LOG_GRACE_S:
            for p in streaming:
                with contextlib.suppress(ProcessLookupError):
                    p.kill()
        done = self.ended_at is not None and not streaming
        return drain(self.lines), done

    def _check(self, now: float) -> None:
        """Read the job's and its pods' state, follow new pods' logs, note the end: the
        job has succeeded, failed or is gone, and none of its pods may still run."""
        try:
            job = self._kubectl("get", "pytorchjob", self.job_name, "-o", "json")
            pods = self._kubectl("get", "pods", "-l", f"{OPERATOR_JOB}={self.job_name}",
                                 "-o", "json")
        except RuntimeError as e:  # kubectl hung: like a failed call
            job = pods = subprocess.CompletedProcess([], 1, "", str(e))
        gone = job.returncode != 0 and "NotFound" in job.stderr
        if (job.returncode != 0 and not gone) or pods.returncode != 0:
            self.failing_since = self.failing_since or now
            if now - self.failing_since > KUBECTL_FAILING_S:
                raise self._failed("read", job if job.returncode else pods)
            return
        self.failing_since = None
        conditions = {} if gone else {
            c.get("type"): c.get("status")
            for c in json.loads(job.stdout).get("status", {}).get("conditions") or []}
        finished = gone or "True" in (conditions.get("Succeeded"), conditions.get("Failed"))
        running = [self._pod(pod) for pod in json.loads(pods.stdout).get("items", [])]
        if finished and not any(running):
            self.ended_at = now

    def _pod(self, pod: dict[str, Any]) -> bool:
        """Note one pod's phase and exit code and follow its log; whether it may run."""
        name = pod["metadata"]["name"]
        labels = pod["metadata"].get("labels", {})
        index = int(labels.get(OPERATOR_INDEX, 0))
        if labels.get(OPERATOR_TYPE, "").lower() == "worker":
            index += 1
        status = pod.get("status", {})
        phase = status.get("phase", "Unknown")
        containers = status.get("containerStatuses") or []
        for c in containers:
            if c.get("name") == CONTAINER and c.get("state", {}).get("terminated"):
                self.codes[index] = c["state"]["terminated"].get("exitCode")
        why = [c.get("state", {}).get("waiting", {}).get("reason") for c in containers]
        why += [c.get("message") for c in status.get("conditions") or []]
        reason = "; ".join(w for w in why if w)
        described = phase + (f" ({reason})" if reason else "")
        if self.phases.get(name) != described:  # Pending (ErrImagePull), Running, ...
            self.phases[name] = described
            self.lines.put((-1, f"[modelparallel] pod {name}: {described}"))
        if phase in ("Running", "Succeeded", "Failed") and name not in self.followers:
            self._follow(name, index)
        return phase not in ("Succeeded", "Failed")

    def _follow(self, pod: str, index: int) -> None:
        proc = subprocess.Popen([self.kubectl, "logs", "-f", pod, "-c", CONTAINER,
                                 "-n", self.namespace],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, text=True, errors="replace",
                                bufsize=1)

        def read() -> None:
            assert proc.stdout is not None  # stdout=PIPE
            for line in proc.stdout:
                self.lines.put((index, line.rstrip("\n")))
            proc.wait()

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        self.followers[pod] = (proc, reader)

    def exit_codes(self) -> dict[int, int | None]:
        return dict(self.codes)

    def stop(self) -> None:
        """Delete the PyTorchJob; Kubernetes deletes its pods, and poll() sees the end."""
        if not self.created:
            return
        proc = self._kubectl("delete", "pytorchjob", self.job_name, "--ignore-not-found",
                             "--wait=false")
        if proc.returncode != 0:
            raise self._failed("delete", proc)

    def info(self) -> dict[str, Any]:
        return {"pytorchjob": self.job_name, "namespace": self.namespace}
