"""Model and output archives, and the checkpoint directory synced with a URI."""

from __future__ import annotations

import os
import shutil
import tarfile
from pathlib import Path

from fsspec.core import url_to_fs
from fsspec.implementations.local import LocalFileSystem


def _unfinished(name: str) -> bool:
    """A checkpoint save in progress, one being replaced, or a file being replaced
    (modelparallel.checkpoint's names: .tmp-TAG-..., .old-..., .newest.tmp-PID)."""
    return name.startswith((".tmp-", ".old-")) or (name.startswith(".") and ".tmp-" in name)


def pack(directory: Path, archive: Path) -> None:
    """``directory``'s contents as a gzipped tar (members relative to it, like
    SageMaker's model.tar.gz)."""
    archive.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(archive, "w:gz") as tar:
        for path in sorted(directory.rglob("*")):
            tar.add(path, arcname=str(path.relative_to(directory)), recursive=False)


def upload(local: Path, uri: str) -> None:
    fs, path = url_to_fs(uri)
    fs.makedirs(os.path.dirname(path), exist_ok=True)
    if isinstance(fs, LocalFileSystem):
        tmp = f"{path}.partial"
        shutil.copyfile(local, tmp)
        os.replace(tmp, path)  # a reader never sees half an archive
    else:
        fs.put_file(str(local), path)


def remove(uri: str) -> None:
    fs, path = url_to_fs(uri)
    if fs.exists(path):
        fs.rm_file(path)


def join(uri: str, *parts: str) -> str:
    return "/".join([uri.rstrip("/"), *parts])


def _files(directory: Path) -> dict[str, Path]:
    out = {}
    for path in directory.rglob("*"):
        rel = path.relative_to(directory)
        if path.is_file() and not any(_unfinished(p) for p in rel.parts):
            out[rel.as_posix()] = path
    return out


def sync_up(directory: Path, uri: str) -> int:
    """Make ``uri`` mirror the finished checkpoints in ``directory``; files copied.

    Files in subdirectories go first and top-level files (``newest``) last, so the URI
    never names a checkpoint whose files are not all there yet.
    """
    fs, root = url_to_fs(uri)
    root = root.rstrip("/")
    copied = 0
    local = _files(directory)
    for rel, path in sorted(local.items(), key=lambda item: ("/" not in item[0], item[0])):
        target = f"{root}/{rel}"
        try:
            stat = path.stat()
        except FileNotFoundError:  # rotated away since the listing
            continue
        try:
            info = fs.info(target)
            if info.get("size") == stat.st_size and _mtime(info) >= stat.st_mtime:
                continue
        except FileNotFoundError:
            pass
        fs.makedirs(os.path.dirname(target), exist_ok=True)
        try:
            fs.put_file(str(path), target)
        except FileNotFoundError:
            continue
        copied += 1
    if fs.exists(root):  # checkpoints rotated away locally
        for path in fs.find(root):
            rel = path[len(root) + 1:]
            if rel not in local and not any(_unfinished(p) for p in rel.split("/")):
                fs.rm_file(path)
    return copied


def _mtime(info: dict) -> float:
    value = info.get("mtime", info.get("LastModified", info.get("created", 0)))
    return value.timestamp() if hasattr(value, "timestamp") else float(value or 0)


def restore(uri: str, directory: Path) -> int:
    """Copy everything under ``uri`` into ``directory``; how many files."""
    fs, root = url_to_fs(uri)
    root = root.rstrip("/")
    if not fs.exists(root):
        return 0
    count = 0
    for path in sorted(fs.find(root)):
        rel = path[len(root) + 1:]
        target = directory / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        fs.get_file(path, str(target))
        count += 1
    return count
