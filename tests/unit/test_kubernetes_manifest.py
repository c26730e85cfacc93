"""The kubernetes backend's PyTorchJob: valid against the training operator's own CRD
schema (tests/data/kubeflow.org_pytorchjobs.yaml), with the command, replicas, mounts
and policies the instances need; its option checks; the CLI's dry run; and start/poll/
exit_codes/stop against a stand-in kubectl."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
import time
from pathlib import Path

import jsonschema
import pytest
import yaml

from modelparallel.jobs.backends import JobContext, backend_class, kubernetes
from modelparallel.jobs.backends.kubernetes import KubernetesBackend
from modelparallel.jobs.layout import JobLayout
from modelparallel.jobs.spec import build_spec

CRD = Path(__file__).parents[1] / "data" / "kubeflow.org_pytorchjobs.yaml"
IMAGE = "registry.example.com/team/mp-train:1.0"
DNS_1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")

# -- the CRD's schema as JSON Schema --------------------------------------------------


def to_json_schema(node: dict) -> dict:
    """An OpenAPI v3 structural schema node as Draft 7 JSON Schema.

    Dropped: description, default, format and the x-kubernetes-* annotations (except
    x-kubernetes-list-map-keys, checked by the extended validator below). ``nullable``
    adds "null" to the type, ``x-kubernetes-int-or-string`` becomes integer-or-string.
    An object with declared properties rejects others, as the API server's strict field
    validation does (kubectl's default), unless x-kubernetes-preserve-unknown-fields.
    """
    out: dict = {}
    for key, value in node.items():
        if key == "properties":
            out[key] = {name: to_json_schema(sub) for name, sub in value.items()}
        elif key in ("items", "additionalProperties", "not") and isinstance(value, dict):
            out[key] = to_json_schema(value)
        elif key in ("anyOf", "allOf", "oneOf"):
            out[key] = [to_json_schema(sub) for sub in value]
        elif key == "x-kubernetes-list-map-keys":
            out[key] = value
        elif key in ("description", "default", "format", "example") or key.startswith("x-"):
            continue
        else:
            out[key] = value
    if node.get("x-kubernetes-int-or-string") and "anyOf" not in out:
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    if node.get("nullable") and "type" in out:
        out["type"] = [out["type"], "null"]
    out.pop("nullable", None)
    if ("properties" in out and "additionalProperties" not in out
            and not node.get("x-kubernetes-preserve-unknown-fields")):
        out["additionalProperties"] = False
    return out


def _list_map_keys(validator, keys, instance, schema):
    """x-kubernetes-list-type: map: no two items with the same key fields."""
    if not validator.is_type(instance, "array"):
        return
    seen = set()
    for item in instance:
        if isinstance(item, dict):
            key = tuple(item.get(k) for k in keys)
            if key in seen:
                yield jsonschema.ValidationError(f"duplicate item for keys {keys}: {key}")
            seen.add(key)


Validator = jsonschema.validators.extend(jsonschema.Draft7Validator,
                                         {"x-kubernetes-list-map-keys": _list_map_keys})


@pytest.fixture(scope="module")
def crd() -> dict:
    return yaml.safe_load(CRD.read_text())


@pytest.fixture(scope="module")
def validator(crd):
    assert crd["kind"] == "CustomResourceDefinition"
    assert crd["spec"]["group"] == "kubeflow.org" and crd["spec"]["names"]["kind"] == "PyTorchJob"
    (v1,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    schema = to_json_schema(v1["schema"]["openAPIV3Schema"])
    Validator.check_schema(schema)
    return Validator(schema)


def errors(validator, manifest: dict) -> list[str]:
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}"
            for e in validator.iter_errors(manifest)]


# -- jobs -----------------------------------------------------------------------------


def make_job(tmp_path: Path, instance_count: int = 2, name: str = "mp-job", *,
             max_run: float | None = 3600.5, jobs_dir: Path | None = None,
             **options) -> JobContext:
    script = tmp_path / "train.py"
    script.write_text("print('training')\n")
    backend_options = {"image": IMAGE, "volume_claim": "jobs-pvc", **options}
    spec = build_spec(
        entry_point=str(script), source_dir=None, instance_count=instance_count,
        processes_per_host=1, hyperparameters={"epochs": 2}, distribution=None,
        inputs=None, output_path=str(tmp_path / "out"), checkpoint_uri=None,
        environment={"FOO": "bar"}, max_run=max_run, max_restarts=2,
        metric_definitions=None, backend="kubernetes",
        backend_options={k: v for k, v in backend_options.items() if v is not None},
        name=name)
    jobs_dir = jobs_dir or tmp_path / "jobs"
    return JobContext(spec, JobLayout(jobs_dir / spec.name), attempt=1)


def manifest_of(job: JobContext) -> dict:
    backend = KubernetesBackend(job.spec.backend_options)
    rendered = yaml.safe_load(backend.render(job))
    assert rendered == backend.manifest(job)
    return rendered


def expand(arg: str, env: dict[str, str]) -> str:
    """Kubernetes' expansion of a command argument: $(VAR) if VAR is defined, $$ -> $."""
    return re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)",
                  lambda m: "$" if m.group(0) == "$$" else env.get(m.group(1), m.group(0)),
                  arg)


# -- the manifest ---------------------------------------------------------------------


@pytest.mark.parametrize("instance_count", [1, 2, 4])
def test_manifest_validates_against_the_crd(tmp_path, validator, instance_count):
    job = make_job(tmp_path, instance_count)
    manifest = manifest_of(job)
    assert errors(validator, manifest) == []

    assert manifest["apiVersion"] == "kubeflow.org/v1"
    assert manifest["kind"] == "PyTorchJob"
    meta = manifest["metadata"]
    assert meta["name"] == "mp-job" and DNS_1035.match(meta["name"])
    assert meta["namespace"] == "default"
    assert meta["labels"] == {"app.kubernetes.io/managed-by": "modelparallel",
                              "modelparallel/job": "mp-job"}

    replicas = manifest["spec"]["pytorchReplicaSpecs"]
    assert replicas["Master"]["replicas"] == 1
    if instance_count == 1:
        assert set(replicas) == {"Master"}
    else:
        assert set(replicas) == {"Master", "Worker"}
        assert replicas["Worker"]["replicas"] == instance_count - 1
    assert sum(r["replicas"] for r in replicas.values()) == instance_count

    run_policy = manifest["spec"]["runPolicy"]
    assert run_policy["activeDeadlineSeconds"] == math.ceil(3600.5) == 3601
    assert run_policy["backoffLimit"] == 0
    assert run_policy["cleanPodPolicy"] == "None"

    jobs_dir = str(tmp_path / "jobs")
    for rtype, replica in replicas.items():
        assert replica["restartPolicy"] == "Never"
        template = replica["template"]
        assert template["metadata"]["labels"]["modelparallel/job"] == "mp-job"
        pod = template["spec"]
        (container,) = pod["containers"]
        assert container["name"] == "pytorch", rtype
        assert container["image"] == IMAGE
        assert container["command"] == [
            "python", "-m", "modelparallel.jobs.instance", str(job.layout.root),
            "--index", "$(RANK)", "--rdzv-endpoint", "$(MASTER_ADDR):$(MASTER_PORT)",
            "--local-addr", "$(POD_NAME)", "--rdzv-id", "mp-job-1"]
        assert container["ports"] == [{"name": "pytorchjob-port", "containerPort": 23456}]
        env = {e["name"]: e for e in container["env"]}
        assert env["FOO"] == {"name": "FOO", "value": "bar"}
        assert env["POD_NAME"]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.name"}}
        mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
        assert mounts == {"dshm": "/dev/shm", "jobs": jobs_dir}
        assert str(job.layout.root).startswith(mounts["jobs"] + "/")
        volumes = {v["name"]: v for v in pod["volumes"]}
        assert volumes["jobs"]["persistentVolumeClaim"] == {"claimName": "jobs-pvc"}
        assert volumes["dshm"]["emptyDir"] == {"medium": "Memory"}
    # the operator names pods and services NAME-master-0, NAME-worker-I (DNS-1035 labels)
    names = ["mp-job-master-0", *(f"mp-job-worker-{i}" for i in range(instance_count - 1))]
    assert all(DNS_1035.match(n) and len(n) <= 63 for n in names)


def test_command_after_kubernetes_expansion_is_the_instance_command(tmp_path):
    """With the variables the operator sets in Worker 1's pod, the container runs what
    JobContext.command builds for instance 2; a literal $( in the path stays literal."""
    job = make_job(tmp_path, 3, jobs_dir=tmp_path / "odd $(HOME) dir")
    (container,) = manifest_of(job)["spec"]["pytorchReplicaSpecs"]["Worker"]["template"][
        "spec"]["containers"]
    assert "$$(HOME)" in container["command"][3]
    pod_env = {"RANK": "2", "MASTER_ADDR": "mp-job-master-0", "MASTER_PORT": "23456",
               "POD_NAME": "mp-job-worker-1", "HOME": "/root"}
    expanded = [expand(arg, pod_env) for arg in container["command"]]
    expected = JobContext(job.spec, job.layout, job.attempt, python="python").command(
        2, "mp-job-master-0:23456", "mp-job-worker-1")
    assert expanded == expected
    assert expanded[3] == str(tmp_path / "odd $(HOME) dir" / "mp-job")


def test_local_addresses_sort_in_instance_order(tmp_path):
    """torchrun's c10d rendezvous numbers nodes in the order of their addresses, and each
    instance must be the node its index says: the pod names sort that way up to 11
    instances, and check() refuses more."""
    names = ["mp-job-master-0", *(f"mp-job-worker-{i}" for i in range(10))]
    assert sorted(names) == names
    assert sorted([*names, "mp-job-worker-10"]) != [*names, "mp-job-worker-10"]
    assert problems(tmp_path, 11) == {}
    assert "instance order" in problems(tmp_path, 12)["instance_count"]


def test_optional_fields(tmp_path, validator):
    job = make_job(tmp_path, 2, max_run=None, volume_claim=None, namespace="training",
                   service_account="trainer", python="python3",
                   resources={"limits": {"nvidia.com/gpu": 1, "memory": "64Gi"},
                              "requests": {"cpu": "8"}},
                   labels={"team": "vision"})
    manifest = manifest_of(job)
    assert errors(validator, manifest) == []
    assert "activeDeadlineSeconds" not in manifest["spec"]["runPolicy"]
    assert manifest["metadata"]["namespace"] == "training"
    assert manifest["metadata"]["labels"]["team"] == "vision"
    pod = manifest["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]
    assert pod["serviceAccountName"] == "trainer"
    assert [v["name"] for v in pod["volumes"]] == ["dshm"]
    (container,) = pod["containers"]
    assert container["command"][0] == "python3"
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1


def test_the_replica_specs_are_independent_copies(tmp_path):
    manifest = KubernetesBackend({"image": IMAGE}).manifest(make_job(tmp_path, 2))
    specs = manifest["spec"]["pytorchReplicaSpecs"]
    assert specs["Master"]["template"] is not specs["Worker"]["template"]
    assert specs["Master"]["template"]["spec"] is not specs["Worker"]["template"]["spec"]
    assert "&id" not in KubernetesBackend({"image": IMAGE}).render(make_job(tmp_path, 2))


# -- the validation can fail ----------------------------------------------------------


def _break(manifest: dict, how: str) -> dict:
    worker = manifest["spec"]["pytorchReplicaSpecs"]["Worker"]
    container = worker["template"]["spec"]["containers"][0]
    if how == "replicas":
        worker["replicas"] = "two"
    elif how == "unknown field":
        container["imagee"] = IMAGE
    elif how == "deadline":
        manifest["spec"]["runPolicy"]["activeDeadlineSeconds"] = "1h"
    elif how == "duplicate env":
        container["env"].append({"name": "FOO", "value": "baz"})
    elif how == "container without name":
        del container["name"]
    elif how == "no replica specs":
        del manifest["spec"]["pytorchReplicaSpecs"]
    elif how == "quantity":
        container["resources"] = {"limits": {"memory": "lots"}}
    return manifest


@pytest.mark.parametrize("how, where", [
    ("replicas", "spec/pytorchReplicaSpecs/Worker/replicas"),
    ("unknown field", "spec/pytorchReplicaSpecs/Worker/template/spec/containers/0"),
    ("deadline", "spec/runPolicy/activeDeadlineSeconds"),
    ("duplicate env", "spec/pytorchReplicaSpecs/Worker/template/spec/containers/0/env"),
    ("container without name", "spec/pytorchReplicaSpecs/Worker/template/spec/containers/0"),
    ("no replica specs", "spec"),
    ("quantity", "spec/pytorchReplicaSpecs/Worker/template/spec/containers/0/resources/"
                 "limits/memory"),
])
def test_invalid_manifests_are_rejected(tmp_path, validator, how, where):
    manifest = _break(manifest_of(make_job(tmp_path, 2)), how)
    found = errors(validator, manifest)
    assert found, f"{how}: accepted"
    assert any(e.startswith(where + ":") for e in found), found


# -- check() --------------------------------------------------------------------------


def problems(tmp_path, instance_count=2, name="mp-job", **options):
    job = make_job(tmp_path, instance_count, name, **options)
    return dict(KubernetesBackend.check(job.spec))


def test_check_accepts_a_good_job(tmp_path):
    assert problems(tmp_path) == {}


def test_check_requires_an_image(tmp_path):
    found = problems(tmp_path, image=None)
    assert list(found) == ["backend_options.image"]
    assert "container image" in found["backend_options.image"]


def test_check_rejects_unknown_and_malformed_options(tmp_path):
    found = problems(tmp_path, nodes=3, namespace="Bad_NS", resources={"gpus": 8},
                     labels={"a": 1})
    assert "unknown option" in found["backend_options.nodes"]
    assert "image" in found["backend_options.nodes"]  # lists the valid options
    assert set(found) == {"backend_options.nodes", "backend_options.namespace",
                          "backend_options.resources", "backend_options.labels"}


@pytest.mark.parametrize("name, instance_count", [("Mp-Job", 2), ("1-job", 2),
                                                   ("j" * 55, 2), ("j" * 55, 11)])
def test_check_rejects_names_kubernetes_cannot_use(tmp_path, name, instance_count):
    found = problems(tmp_path, instance_count, name)
    assert list(found) == ["job_name"]


def test_check_accepts_the_longest_name(tmp_path):
    assert problems(tmp_path, 11, "j" * 54) == {}  # j...j-worker-9: 63 characters


def test_check_rejects_more_processes_than_gpus(tmp_path):
    job = make_job(tmp_path, 2, resources={"limits": {"nvidia.com/gpu": 2}})
    job.spec.processes_per_host = 4
    assert [f for f, _ in KubernetesBackend.check(job.spec)] == ["processes_per_host"]


def test_check_rejects_environment_kubernetes_cannot_set(tmp_path):
    job = make_job(tmp_path, 2)
    job.spec.environment = {"POD_NAME": "x", "1BAD": "y", "GOOD_ONE": "z"}
    assert [f for f, _ in KubernetesBackend.check(job.spec)] == ["environment.POD_NAME",
                                                                 "environment.1BAD"]


def test_backend_is_registered():
    assert backend_class("kubernetes") is KubernetesBackend
    assert set(KubernetesBackend.options_doc) >= {"image", "namespace", "volume_claim",
                                                  "service_account", "resources", "kubectl"}


# -- the CLI's dry run ----------------------------------------------------------------


def cli(*args: str, cwd: Path, jobs_dir: Path) -> subprocess.CompletedProcess:
    script = Path(sys.executable).with_name("modelparallel")
    command = [str(script)] if script.is_file() else [
        sys.executable, "-c", "from modelparallel.launch.cli import main; main()"]
    env = {"PATH": str(Path(sys.executable).parent), "MODELPARALLEL_JOBS_DIR": str(jobs_dir),
           "HOME": str(cwd)}
    return subprocess.run([*command, *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=300)


def test_cli_dry_run_prints_a_valid_manifest(tmp_path, validator):
    (tmp_path / "train.py").write_text("print('training')\n")
    (tmp_path / "job.yaml").write_text(yaml.safe_dump({
        "entry_point": "train.py", "instance_count": 3, "processes_per_host": 2,
        "max_run": 600, "job_name": "digits-k8s", "backend": "kubernetes",
        "backend_options": {"image": IMAGE, "volume_claim": "jobs-pvc",
                            "resources": {"limits": {"nvidia.com/gpu": 2}}}}))
    jobs_dir = tmp_path / "jobs"
    proc = cli("jobs", "submit", "job.yaml", "--dry-run", cwd=tmp_path, jobs_dir=jobs_dir)
    assert proc.returncode == 0, proc.stderr
    manifest = yaml.safe_load(proc.stdout)
    assert errors(validator, manifest) == []
    assert manifest["metadata"]["name"] == "digits-k8s"
    assert manifest["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"] == 2
    assert manifest["spec"]["runPolicy"]["activeDeadlineSeconds"] == 600
    (container,) = manifest["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"][
        "containers"]
    assert container["command"][3] == str(jobs_dir.resolve() / "digits-k8s")
    assert {"name": "jobs", "mountPath": str(jobs_dir.resolve())} in container["volumeMounts"]
    assert not (jobs_dir / "digits-k8s").exists()  # a dry run starts nothing


def test_cli_dry_run_names_the_missing_image(tmp_path):
    (tmp_path / "train.py").write_text("print('training')\n")
    (tmp_path / "job.yaml").write_text(yaml.safe_dump({
        "entry_point": "train.py", "processes_per_host": 1, "backend": "kubernetes"}))
    proc = cli("jobs", "submit", "job.yaml", "--dry-run", cwd=tmp_path,
               jobs_dir=tmp_path / "jobs")
    assert proc.returncode == 2
    assert "backend_options.image" in proc.stderr


# -- start / poll / exit_codes / stop against a stand-in kubectl ----------------------

FAKE_KUBECTL = '''#!{python}
import json, pathlib, sys
here = pathlib.Path({state_dir!r})
args = sys.argv[1:]
with open(here / "calls.jsonl", "a") as f:
    f.write(json.dumps(args) + "\\n")
if args[0] == "logs":
    print("hello from " + args[2])
    sys.exit(0)
state = json.loads((here / "state.json").read_text())
if args[0] == "create":
    if state.get("create_error"):
        sys.exit(sys.stderr.write(state["create_error"]) and 1)
    (here / "created.json").write_text(sys.stdin.read())
elif args[:2] == ["get", "pytorchjob"]:
    if state.get("job") is None:
        sys.stderr.write('Error from server (NotFound): pytorchjobs.kubeflow.org '
                         '"%s" not found' % args[2])
        sys.exit(1)
    print(json.dumps(state["job"]))
elif args[:2] == ["get", "pods"]:
    print(json.dumps({{"items": state.get("pods", [])}}))
'''


class FakeCluster:
    def __init__(self, tmp_path: Path):
        self.dir = tmp_path / "cluster"
        self.dir.mkdir()
        self.kubectl = self.dir / "kubectl"
        self.kubectl.write_text(FAKE_KUBECTL.format(python=sys.executable,
                                                    state_dir=str(self.dir)))
        self.kubectl.chmod(0o755)
        self.set()

    def set(self, **state):
        """The cluster's state for the next kubectl calls (replaced atomically: a call
        may be reading it)."""
        tmp = self.dir / "state.json.tmp"
        tmp.write_text(json.dumps(state))
        tmp.replace(self.dir / "state.json")

    def calls(self) -> list[list[str]]:
        path = self.dir / "calls.jsonl"
        text = path.read_text() if path.is_file() else ""
        return [json.loads(line) for line in text.split("\n")[:-1]]  # whole lines only


def pod(name: str, rtype: str, index: int, phase: str, exit_code: int | None = None) -> dict:
    state = {"terminated": {"exitCode": exit_code}} if exit_code is not None else \
        {"running": {}}
    return {"metadata": {"name": name, "labels": {
                "training.kubeflow.org/job-name": "mp-job",
                "training.kubeflow.org/replica-type": rtype,
                "training.kubeflow.org/replica-index": str(index)}},
            "status": {"phase": phase,
                       "containerStatuses": [{"name": "pytorch", "state": state}]}}


def job_status(*conditions: str) -> dict:
    return {"status": {"conditions": [{"type": c, "status": "True"} for c in conditions]}}


def poll_until_done(backend, timeout=30.0) -> list[tuple[int, str]]:
    lines, deadline = [], time.monotonic() + timeout
    while time.monotonic() < deadline:
        out, done = backend.poll()
        lines += out
        if done:
            return lines
        time.sleep(0.05)
    raise AssertionError(f"poll() never reported the end; lines so far: {lines}")


@pytest.fixture
def cluster(tmp_path, monkeypatch):
    monkeypatch.setattr(kubernetes, "CHECK_S", 0.0)
    return FakeCluster(tmp_path)


def test_a_job_that_succeeds(tmp_path, cluster):
    job = make_job(tmp_path, 2)
    backend = KubernetesBackend({**job.spec.backend_options, "kubectl": str(cluster.kubectl)})
    backend.start(job)
    created = json.loads((cluster.dir / "created.json").read_text())
    assert created == backend.manifest(job)
    assert cluster.calls()[0][:3] == ["delete", "pytorchjob", "-l"]  # the earlier attempt
    assert cluster.calls()[1] == ["create", "-f", "-", "-n", "default"]

    cluster.set(job=job_status("Created", "Running", "Succeeded"),
                pods=[pod("mp-job-master-0", "master", 0, "Succeeded", 0),
                      pod("mp-job-worker-0", "worker", 0, "Succeeded", 0)])
    lines = poll_until_done(backend)
    assert (0, "hello from mp-job-master-0") in lines
    assert (1, "hello from mp-job-worker-0") in lines
    assert (-1, "[modelparallel] pod mp-job-worker-0: Succeeded") in lines
    assert backend.exit_codes() == {0: 0, 1: 0}
    assert backend.info() == {"pytorchjob": "mp-job", "namespace": "default"}


def test_a_failed_instance_then_stop(tmp_path, cluster):
    job = make_job(tmp_path, 3)
    backend = KubernetesBackend({**job.spec.backend_options, "kubectl": str(cluster.kubectl)})
    backend.start(job)
    cluster.set(job=job_status("Created", "Running", "Failed"),
                pods=[pod("mp-job-master-0", "master", 0, "Running"),
                      pod("mp-job-worker-0", "worker", 0, "Pending"),
                      pod("mp-job-worker-1", "worker", 1, "Failed", 3)])
    out, done = backend.poll()
    assert not done  # the job failed, but two pods may still run
    assert backend.exit_codes() == {0: None, 1: None, 2: 3}

    backend.stop()
    assert ["delete", "pytorchjob", "mp-job", "--ignore-not-found", "--wait=false",
            "-n", "default"] in cluster.calls()
    cluster.set(job=None, pods=[])
    lines = out + poll_until_done(backend)
    assert (0, "hello from mp-job-master-0") in lines
    assert not any(line == "hello from mp-job-worker-0" for _, line in lines)  # pending
    backend.stop()  # idempotent


def test_start_names_kubectls_error(tmp_path, cluster):
    cluster.set(create_error='E1121 19:51:52.864178   16848 memcache.go:265] "Unhandled '
                             'Error" err="couldn\'t get current server API group list"\n'
                             'error: resource mapping not found for name: "mp-job": no '
                             'matches for kind "PyTorchJob" in version "kubeflow.org/v1"')
    job = make_job(tmp_path, 2)
    backend = KubernetesBackend({**job.spec.backend_options, "kubectl": str(cluster.kubectl)})
    with pytest.raises(RuntimeError, match=r"training operator installed.*no matches for "
                                           r"kind \"PyTorchJob\"") as info:
        backend.start(job)
    assert "memcache.go" not in str(info.value)  # client-go's log lines are left out
    calls = len(cluster.calls())
    backend.stop()  # nothing was created: nothing to delete
    assert len(cluster.calls()) == calls


def test_start_without_kubectl(tmp_path):
    job = make_job(tmp_path, 2)
    backend = KubernetesBackend({**job.spec.backend_options,
                                 "kubectl": str(tmp_path / "no-such-kubectl")})
    with pytest.raises(RuntimeError, match="no-such-kubectl"):
        backend.start(job)
