"""Data channels: where a job's input data comes from and how each instance sees it.

A channel's source is a local path, a ``file://`` URL or any fsspec URL (``s3://`` with
s3fs installed). ``File`` mode copies the files into the instance's channel directory
before the script starts; ``FastFile`` lets the script read them in place (a local
source is used where it is; a remote one is handed over as its URL, to be streamed
with ``fsspec.open``). ``ShardedByKey`` gives each instance every ``instance_count``-th
file in key order, so instances see disjoint subsets; ``FullyReplicated`` gives all.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fsspec.core import url_to_fs
from fsspec.implementations.local import LocalFileSystem

from modelparallel.jobs.errors import JobError

INPUT_MODES = ("File", "FastFile")
DISTRIBUTIONS = ("FullyReplicated", "ShardedByKey")


@dataclass
class TrainingInput:
    """One input channel, as SageMaker's ``TrainingInput``: a source URI or path, how it
    is split over instances (``distribution``) and how it is read (``input_mode``)."""

    uri: str
    distribution: str = "FullyReplicated"
    input_mode: str = "File"
    content_type: str | None = None  # passed to the script as MP_CHANNEL_<NAME>_CONTENT_TYPE

    @property
    def is_local(self) -> bool:
        return "://" not in self.uri or self.uri.startswith("file://")

    @property
    def local_path(self) -> Path:
        return Path(self.uri.removeprefix("file://"))


def check_channel(value: Any, where: str) -> TrainingInput:
    """A TrainingInput for ``value`` (a path, URL or TrainingInput) whose source exists."""
    if isinstance(value, dict):
        try:
            value = TrainingInput(**value)
        except TypeError as e:
            raise JobError([(where, f"{e}; fields are uri, distribution, input_mode, "
                                    f"content_type")]) from None
    elif isinstance(value, str | os.PathLike):
        value = TrainingInput(os.fspath(value))
    elif not isinstance(value, TrainingInput):
        raise JobError([(where, f"is {type(value).__name__}; expected a path, a URL or a "
                                f"TrainingInput")])
    problems = []
    if value.distribution not in DISTRIBUTIONS:
        problems.append((f"{where}.distribution", f"{value.distribution!r} is not one of "
                                                  f"{', '.join(DISTRIBUTIONS)}"))
    if value.input_mode not in INPUT_MODES:
        problems.append((f"{where}.input_mode", f"{value.input_mode!r} is not one of "
                                                f"{', '.join(INPUT_MODES)}"))
    if (value.input_mode == "FastFile" and value.distribution == "ShardedByKey"
            and not value.is_local):
        problems.append((where, "ShardedByKey needs a local source in FastFile mode (a "
                                "remote one is handed over as one URL); use input_mode "
                                "'File'"))
    if value.is_local:
        value = TrainingInput(str(value.local_path.resolve()), value.distribution,
                              value.input_mode, value.content_type)
    try:
        exists = _exists(value.uri)
    except Exception as e:  # a missing fsspec backend (s3fs), bad credentials, ...
        problems.append((where, f"cannot read {value.uri!r}: {type(e).__name__}: {e}"))
    else:
        if not exists:
            problems.append((where, f"{value.uri!r} does not exist"))
    if problems:
        raise JobError(problems)
    return value


def _exists(uri: str) -> bool:
    fs, path = url_to_fs(uri)
    return fs.exists(path)


def list_keys(uri: str) -> list[str]:
    """The files under ``uri`` as keys relative to it, sorted (one key "" for a file)."""
    fs, root = url_to_fs(uri)
    if fs.isfile(root):
        return [""]
    root = root.rstrip("/")
    return sorted(p[len(root) + 1:] for p in fs.find(root) if not fs.isdir(p))


def shard(keys: list[str], index: int, count: int, distribution: str) -> list[str]:
    """The keys instance ``index`` of ``count`` receives."""
    return keys[index::count] if distribution == "ShardedByKey" else keys


def is_private(uri: str) -> bool:
    """A filesystem only this process can see (fsspec's memory://)."""
    return uri.startswith("memory://")


def stage(channel: TrainingInput, dest: Path) -> TrainingInput:
    """Copy a private (memory://) source into ``dest`` so the job's processes see it."""
    copy_files(channel.uri, list_keys(channel.uri), dest)
    return TrainingInput(str(dest), channel.distribution, channel.input_mode,
                         channel.content_type)


def copy_files(uri: str, keys: list[str], dest: Path) -> None:
    fs, root = url_to_fs(uri)
    root = root.rstrip("/")
    dest.mkdir(parents=True, exist_ok=True)
    for key in keys:
        target = dest / (key or Path(root).name)
        target.parent.mkdir(parents=True, exist_ok=True)
        source = f"{root}/{key}" if key else root
        if isinstance(fs, LocalFileSystem):
            shutil.copyfile(source, target)
        else:
            fs.get(source, str(target))


def materialize(channel: TrainingInput, dest: Path, index: int, count: int) -> str:
    """Prepare the channel for instance ``index``; the path (or URL) the script reads."""
    keys = shard(list_keys(channel.uri), index, count, channel.distribution)
    if channel.input_mode == "File":
        copy_files(channel.uri, keys, dest)
        return str(dest)
    if not channel.is_local:  # FastFile, FullyReplicated: stream from the source
        return channel.uri
    source = channel.local_path
    if channel.distribution == "FullyReplicated":
        return str(source)
    dest.mkdir(parents=True, exist_ok=True)  # FastFile + ShardedByKey: links, no copies
    for key in keys:
        target = dest / (key or source.name)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.symlink_to(source / key if key else source)
    return str(dest)
