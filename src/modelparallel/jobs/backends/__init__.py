"""Job backends behind one interface (``Backend``); ``backend_class`` picks one by name."""

from __future__ import annotations

from modelparallel.jobs.backends.base import Backend, JobContext


def backend_class(name: str) -> type[Backend]:
    if name == "local":
        from modelparallel.jobs.backends.local import LocalBackend
        return LocalBackend
    if name == "ray":
        from modelparallel.jobs.backends.ray import RayBackend
        return RayBackend
    if name == "slurm":
        from modelparallel.jobs.backends.slurm import SlurmBackend
        return SlurmBackend
    if name == "kubernetes":
        from modelparallel.jobs.backends.kubernetes import KubernetesBackend
        return KubernetesBackend
    raise ValueError(f"no backend named {name!r}")


__all__ = ["Backend", "JobContext", "backend_class"]
