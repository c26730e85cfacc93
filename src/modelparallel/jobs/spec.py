"""A training job's description, read from the Estimator or a YAML file, checked before
anything starts.

The checks name the field at fault (``entry_point``, ``inputs.train``,
``distribution.smdistributed.modelparallel.parameters.tensor_parallel_degree`` ...) so a
bad job never reaches a backend.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from modelparallel.config import Config, ConfigError, normalise
from modelparallel.jobs.channels import TrainingInput, check_channel
from modelparallel.jobs.errors import JobError
from modelparallel.topology import check_world

NAME_PATTERN = re.compile(r"^[a-zA-Z0-9](-*[a-zA-Z0-9]){0,62}$")  # SageMaker's job names
BACKENDS = ("local", "ray", "slurm", "kubernetes")


@dataclass
class JobSpec:
    """Everything a backend needs to run a job; stored as JSON in the job directory."""

    name: str
    entry_point: str  # relative to source_dir when that is given
    source_dir: str | None
    instance_count: int
    processes_per_host: int
    hyperparameters: dict[str, Any]
    config: dict[str, Any]  # the modelparallel configuration (MP_CONFIG), may be {}
    inputs: dict[str, TrainingInput]
    output_path: str
    checkpoint_uri: str | None
    environment: dict[str, str]
    max_run: float | None
    max_restarts: int
    metric_definitions: list[dict[str, str]]
    backend: str
    backend_options: dict[str, Any] = field(default_factory=dict)
    distribution: dict[str, Any] | None = None  # as the user gave it

    @property
    def world_size(self) -> int:
        return self.instance_count * self.processes_per_host

    @property
    def hosts(self) -> list[str]:
        """SageMaker's host names: ``algo-1`` ... ``algo-N``."""
        return [f"algo-{i + 1}" for i in range(self.instance_count)]

    def script_path(self) -> Path:
        base = Path(self.source_dir) if self.source_dir else Path()
        return (base / self.entry_point).resolve()

    def to_json(self) -> str:
        data = dataclasses.asdict(self)
        data["inputs"] = {k: dataclasses.asdict(v) for k, v in self.inputs.items()}
        return json.dumps(data, indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> JobSpec:
        data = json.loads(text)
        data["inputs"] = {k: TrainingInput(**v) for k, v in data["inputs"].items()}
        return cls(**data)


def parse_distribution(distribution: dict[str, Any] | None,
                       ) -> tuple[dict[str, Any], int | None]:
    """The modelparallel configuration and processes per host a ``distribution`` asks for.

    Ours: ``{"modelparallel": {...config...}}`` or ``{"torch_distributed": {"enabled":
    True}}``; SageMaker's: ``{"smdistributed": {"modelparallel": {"enabled": True,
    "parameters": {...}}}, "mpi": {"enabled": True, "processes_per_host": N}}``,
    ``{"smdistributed": {"dataparallel": {"enabled": True}}}`` and ``{"pytorchddp": ...}``.
    """
    if distribution is None:
        return {}, None
    problems: list[tuple[str, str]] = []
    if not isinstance(distribution, dict):
        raise JobError([("distribution", f"is {type(distribution).__name__}; expected a "
                                         f"mapping such as {{'modelparallel': {{...}}}}")])
    config: dict[str, Any] = {}
    pph = None

    def mapping(value: Any, where: str) -> dict[str, Any]:
        if isinstance(value, dict):
            return value
        problems.append((where, f"is {type(value).__name__}; expected a mapping"))
        return {}

    def unknown(value: dict[str, Any], where: str, known: tuple[str, ...]) -> None:
        for key in value:
            if key not in known:
                problems.append((f"{where}.{key}", f"unknown key; expected one of "
                                                   f"{', '.join(known)}"))

    def config_keys(value: dict[str, Any], where: str) -> dict[str, Any]:
        try:
            return normalise(value, origin=where)
        except ConfigError as e:
            problems.extend((f"{where}.{key}", msg) for key, msg in e.problems)
            return {}

    for kind, value in distribution.items():
        where = f"distribution.{kind}"
        if kind == "modelparallel":
            value = mapping(value, where)
            if set(value) <= {"enabled", "parameters"} and "parameters" in value:
                config = config_keys(mapping(value["parameters"], f"{where}.parameters"),
                                     f"{where}.parameters")
            else:
                config = config_keys(value, where)
        elif kind in ("torch_distributed", "pytorchddp"):
            unknown(mapping(value, where), where, ("enabled",))
        elif kind == "smdistributed":
            value = mapping(value, where)
            unknown(value, where, ("modelparallel", "dataparallel"))
            smp = mapping(value.get("modelparallel", {}), f"{where}.modelparallel")
            unknown(smp, f"{where}.modelparallel", ("enabled", "parameters"))
            if smp.get("enabled", True) and "parameters" in smp:
                config = config_keys(mapping(smp["parameters"], f"{where}.modelparallel."
                                                                "parameters"),
                                     f"{where}.modelparallel.parameters")
            sdp = mapping(value.get("dataparallel", {}), f"{where}.dataparallel")
            unknown(sdp, f"{where}.dataparallel", ("enabled", "custom_mpi_options"))
        elif kind == "mpi":
            value = mapping(value, where)
            unknown(value, where, ("enabled", "processes_per_host", "custom_mpi_options"))
            if value.get("enabled", True) and "processes_per_host" in value:
                pph = value["processes_per_host"]
                if not _positive_int(pph):
                    problems.append((f"{where}.processes_per_host",
                                     f"{pph!r} is not a positive integer"))
                    pph = None
        else:
            problems.append((where, "unknown distribution; expected modelparallel, "
                                    "torch_distributed, smdistributed (with mpi) or "
                                    "pytorchddp"))
    if problems:
        raise JobError(problems)
    return config, pph


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def default_processes_per_host() -> int:
    """One process per GPU, else one per CPU core."""
    import torch

    if torch.cuda.is_available():
        return torch.cuda.device_count()
    return os.cpu_count() or 1


def _config_field(where: str, key: str) -> str:
    return f"{where}.{key}" if where else key


def build_spec(*, entry_point: Any, source_dir: Any, instance_count: Any,
               processes_per_host: Any, hyperparameters: Any, distribution: Any,
               inputs: Any, output_path: Any, checkpoint_uri: Any, environment: Any,
               max_run: Any, max_restarts: Any, metric_definitions: Any, backend: Any,
               backend_options: Any, name: str) -> JobSpec:
    """Check every field and return the JobSpec; raise JobError naming each bad field."""
    problems: list[tuple[str, str]] = []
    # -- code -------------------------------------------------------------------------
    if not entry_point or not isinstance(entry_point, str | os.PathLike):
        problems.append(("entry_point", "is missing; give the training script's path"))
    elif source_dir is not None:
        src = Path(source_dir)
        if not src.is_dir():
            problems.append(("source_dir", f"{os.fspath(source_dir)!r} is not a directory"))
        elif Path(entry_point).is_absolute() or not (src / entry_point).is_file():
            problems.append(("entry_point", f"{os.fspath(entry_point)!r} is not a file in "
                                            f"source_dir {os.fspath(source_dir)!r}; give it "
                                            f"relative to source_dir"))
    elif not Path(entry_point).is_file():
        problems.append(("entry_point", f"{os.fspath(entry_point)!r} does not exist"))
    # -- layout -----------------------------------------------------------------------
    if not _positive_int(instance_count):
        problems.append(("instance_count", f"{instance_count!r} is not a positive integer"))
        instance_count = 1
    try:
        config, mpi_pph = parse_distribution(distribution)
    except JobError as e:
        problems += e.problems
        config, mpi_pph = {}, None
    if processes_per_host is not None and not _positive_int(processes_per_host):
        problems.append(("processes_per_host",
                         f"{processes_per_host!r} is not a positive integer"))
        processes_per_host = None
    if (processes_per_host is not None and mpi_pph is not None
            and processes_per_host != mpi_pph):
        problems.append(("distribution.mpi.processes_per_host",
                         f"{mpi_pph} conflicts with processes_per_host={processes_per_host}; "
                         f"set only one"))
    pph = processes_per_host or mpi_pph or default_processes_per_host()
    if config:
        try:
            check_world(Config.load(config, environ={}), instance_count * pph)
        except ConfigError as e:
            where = _distribution_where(distribution)
            for key, msg in e.problems:
                if key == "world_size":
                    continue
                problems.append((_config_field(where, key),
                                 f"{msg} (instance_count={instance_count} x "
                                 f"processes_per_host={pph} = {instance_count * pph} "
                                 f"processes)"))
    # -- values -----------------------------------------------------------------------
    hps = hyperparameters or {}
    if not isinstance(hps, dict):
        problems.append(("hyperparameters", "expected a mapping of names to values"))
        hps = {}
    for key in hps:
        if not isinstance(key, str) or not re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9_.-]*", key):
            problems.append((f"hyperparameters.{key}", "is not a valid argument name"))
    env = environment or {}
    if not isinstance(env, dict) or not all(isinstance(k, str) for k in env):
        problems.append(("environment", "expected a mapping of variable names to strings"))
        env = {}
    if max_run is not None and (isinstance(max_run, bool) or not isinstance(max_run, int | float)
                                or max_run <= 0):
        problems.append(("max_run", f"{max_run!r} is not a positive number of seconds"))
    if isinstance(max_restarts, bool) or not isinstance(max_restarts, int) or max_restarts < 0:
        problems.append(("max_restarts", f"{max_restarts!r} is not an integer >= 0"))
    metrics = metric_definitions or []
    for i, m in enumerate(metrics if isinstance(metrics, list) else [None]):
        where = f"metric_definitions[{i}]"
        if not isinstance(m, dict) or set(m) != {"Name", "Regex"}:
            problems.append((where, "expected {'Name': ..., 'Regex': ...}"))
            continue
        try:
            if re.compile(m["Regex"]).groups < 1:
                problems.append((f"{where}.Regex", "has no group; capture the value, "
                                                   "e.g. 'loss=([0-9.]+)'"))
        except re.error as e:
            problems.append((f"{where}.Regex", f"is not a valid regular expression ({e})"))
    if backend not in BACKENDS:
        problems.append(("backend", f"{backend!r} is not one of {', '.join(BACKENDS)}"))
    if backend_options is not None and not isinstance(backend_options, dict):
        problems.append(("backend_options", "expected a mapping"))
    if not NAME_PATTERN.match(name):
        problems.append(("job_name", f"{name!r} is not 1-63 letters, digits and hyphens "
                                     f"starting with a letter or digit"))
    for where, uri in (("output_path", output_path), ("checkpoint_uri", checkpoint_uri)):
        if uri is not None and str(uri).startswith("memory://"):
            problems.append((where, "memory:// is private to one process and the job runs "
                                    "in others; use a path, file:// or a shared store"))
    # -- data -------------------------------------------------------------------------
    channels: dict[str, TrainingInput] = {}
    if isinstance(inputs, str | os.PathLike | TrainingInput):
        inputs = {"training": inputs}  # SageMaker's name for a single channel
    for channel, value in (inputs or {}).items():
        where = f"inputs.{channel}"
        if not re.fullmatch(r"[A-Za-z0-9_-]+", str(channel)):
            problems.append((where, "channel names are letters, digits, - and _"))
            continue
        try:
            channels[channel] = check_channel(value, where)
        except JobError as e:
            problems += e.problems
    if problems:
        raise JobError(problems)
    if source_dir is None:
        entry_point = Path(entry_point).resolve()
    return JobSpec(
        name=name, entry_point=os.fspath(entry_point),
        source_dir=str(Path(source_dir).resolve()) if source_dir is not None else None,
        instance_count=instance_count, processes_per_host=pph,
        hyperparameters=dict(hps), config=config, inputs=channels,
        output_path=_absolute(output_path), checkpoint_uri=_absolute(checkpoint_uri),
        environment={k: str(v) for k, v in env.items()}, max_run=max_run,
        max_restarts=max_restarts, metric_definitions=list(metrics), backend=backend,
        backend_options=dict(backend_options or {}), distribution=distribution)


def _absolute(uri: Any) -> Any:
    if uri is None or "://" in str(uri):
        return uri
    return str(Path(uri).resolve())


def _distribution_where(distribution: dict[str, Any] | None) -> str:
    """Where the modelparallel parameters were given, for error messages."""
    if not distribution:
        return "distribution"
    if "modelparallel" in distribution:
        inner = distribution["modelparallel"]
        nested = isinstance(inner, dict) and "parameters" in inner
        return "distribution.modelparallel" + (".parameters" if nested else "")
    return "distribution.smdistributed.modelparallel.parameters"


JOB_FILE_FIELDS = ("entry_point", "source_dir", "instance_count", "processes_per_host",
                   "hyperparameters", "distribution", "inputs", "output_path",
                   "checkpoint_uri", "environment", "max_run", "max_restarts",
                   "metric_definitions", "backend", "backend_options", "job_name")


def read_job_file(path: str | os.PathLike) -> dict[str, Any]:
    """The Estimator's keyword arguments from a YAML (or JSON) job file.

    Relative paths (entry point, source directory, local channels and output paths) are
    taken relative to the file's directory.
    """
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text())
    except OSError as e:
        raise JobError([("job file", f"{path}: {e.strerror or e}")]) from None
    except yaml.YAMLError as e:
        raise JobError([("job file", f"{path} is not valid YAML ({e})")]) from None
    if not isinstance(data, dict):
        raise JobError([("job file", f"{path} holds no mapping of fields")])
    unknown = [k for k in data if k not in JOB_FILE_FIELDS]
    if unknown:
        raise JobError([(k, f"unknown field in {path.name}; valid fields: "
                            f"{', '.join(JOB_FILE_FIELDS)}") for k in unknown])
    base = path.parent.resolve()

    def local(value: Any) -> Any:
        if isinstance(value, str) and "://" not in value and not os.path.isabs(value):
            return str(base / value)
        return value

    if data.get("source_dir") is not None:
        data["source_dir"] = local(data["source_dir"])
    elif data.get("entry_point"):
        data["entry_point"] = local(data["entry_point"])
    for key in ("output_path", "checkpoint_uri"):
        if data.get(key) is not None:
            data[key] = local(data[key])
    inputs = data.get("inputs")
    if isinstance(inputs, dict):
        for channel, value in inputs.items():
            if isinstance(value, dict) and "uri" in value:
                inputs[channel] = {**value, "uri": local(value["uri"])}
            else:
                inputs[channel] = local(value)
    elif isinstance(inputs, str):
        data["inputs"] = local(inputs)
    return data
