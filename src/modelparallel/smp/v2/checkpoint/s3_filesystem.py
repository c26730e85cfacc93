"""``torch.sagemaker.distributed.checkpoint.s3_filesystem``: S3 checkpoint locations.

SMP reaches S3 through s3torchconnector; here ``s3://`` goes through fsspec (``s3fs``
must be installed), like every other checkpoint URL in modelparallel. No test here runs
against a real object store (none is reachable).
"""

from __future__ import annotations

import functools
import logging
import os
import random
import time
from collections.abc import Callable
from typing import Any, TypeVar

from torch.distributed.checkpoint._fsspec_filesystem import FileSystem as FsspecFileSystem

logger = logging.getLogger("modelparallel")

F = TypeVar("F", bound=Callable[..., Any])


def is_s3_uri(path: str | os.PathLike | None) -> bool:
    """Whether ``path`` names an S3 location (``s3://bucket/key``; also the
    ``s3:/bucket/key`` that ``pathlib.Path("s3://...")`` turns it into)."""
    return path is not None and os.fspath(path).startswith("s3:/")


def format_s3_path(path: str | os.PathLike) -> str:
    """``s3://bucket/key`` from a path that ``pathlib.Path`` may have collapsed to
    ``s3:/bucket/key``."""
    text = os.fspath(path)
    if not is_s3_uri(text):
        raise ValueError(f"{text!r} is not an s3:// URI")
    return "s3://" + text[len("s3:/"):].lstrip("/")


def parse_s3_uri(uri: str | os.PathLike) -> tuple[str, str]:
    """``(bucket, key)`` of an S3 URI (the key without a leading ``/``; empty for the
    bucket itself)."""
    rest = format_s3_path(uri)[len("s3://"):]
    bucket, _, key = rest.partition("/")
    if not bucket:
        raise ValueError(f"{os.fspath(uri)!r} names no bucket")
    return bucket, key


def get_s3_region_from_uri(uri: str | os.PathLike) -> str | None:
    """The AWS region to use for ``uri``'s bucket: ``AWS_REGION`` or
    ``AWS_DEFAULT_REGION`` from the environment, else None (s3fs then finds the bucket's
    region itself). SMP asks S3 for the bucket's location; that needs a reachable S3."""
    parse_s3_uri(uri)  # a bad URI is an error, as in SMP
    return os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")


def storage_options(region: str | None) -> dict[str, Any]:
    """fsspec/s3fs options for ``region`` (none for None)."""
    return {"client_kwargs": {"region_name": region}} if region else {}


class S3FileSystem(FsspecFileSystem):
    """DCP's fsspec file system over ``s3://`` (``.fs`` is the s3fs file system once
    ``init_path`` ran). ``region``: the bucket's AWS region (default: s3fs finds it)."""

    def __init__(self, region: str | None = None) -> None:
        super().__init__()
        self.region = region

    def init_path(self, path: str | os.PathLike, **kwargs: Any) -> str | os.PathLike:
        path = format_s3_path(path)
        return super().init_path(path, **{**storage_options(self.region), **kwargs})


def retry_with_jitter(func: F | None = None, *, max_attempts: int = 3,
                      base_delay_s: float = 0.5, max_delay_s: float = 8.0) -> Any:
    """Decorator: call ``func`` again when it raises, up to ``max_attempts`` times in
    all, sleeping a random time up to ``base_delay_s * 2**attempt`` (at most
    ``max_delay_s``) in between; the last failure is raised. Usable bare
    (``@retry_with_jitter``) or with arguments."""
    if func is None:
        return functools.partial(retry_with_jitter, max_attempts=max_attempts,
                                 base_delay_s=base_delay_s, max_delay_s=max_delay_s)
    target = func.__func__ if isinstance(func, staticmethod) else func

    @functools.wraps(target)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        for attempt in range(max_attempts):
            try:
                return target(*args, **kwargs)
            except Exception as e:
                if attempt == max_attempts - 1:
                    raise
                delay = random.uniform(0, min(max_delay_s, base_delay_s * 2 ** attempt))
                logger.warning("%s failed (%s: %s); retrying in %.2fs (%d/%d)",
                               getattr(target, "__qualname__", target), type(e).__name__, e,
                               delay, attempt + 1, max_attempts - 1)
                time.sleep(delay)
        raise AssertionError("unreachable")

    return staticmethod(wrapper) if isinstance(func, staticmethod) else wrapper


__all__ = ["S3FileSystem", "format_s3_path", "get_s3_region_from_uri", "is_s3_uri",
           "parse_s3_uri", "retry_with_jitter"]
