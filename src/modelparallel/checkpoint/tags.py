"""Which checkpoints under a root are complete and intact, and which is the newest.

A checkpoint's ``checkpoint.json`` is written last: it lists every other file of the
checkpoint with its size. A tag is *intact* when its ``checkpoint.json`` is there and
every file it lists has the recorded size; otherwise it is *damaged* (a file truncated
or lost after the save, e.g. a full disk or a copy cut short) and is never offered as
one to resume from. Checking costs one directory listing, no reading.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch.distributed as dist

from modelparallel.checkpoint.storage import CheckpointError, Location

logger = logging.getLogger("modelparallel")

NEWEST = "newest"
MANIFEST = "checkpoint.json"


def damage(location: Location, tag: str) -> str | None:
    """Why ``location/tag`` cannot be resumed from (None: it is intact)."""
    if not location.exists(tag):
        return "it does not exist"
    try:
        manifest = location.read_json(tag, MANIFEST)
    except FileNotFoundError:
        return f"it has no {MANIFEST} (the save never completed)"
    except ValueError as e:
        return f"its {MANIFEST} is unreadable ({e})"
    recorded: dict[str, int] = manifest.get("files", {}) if isinstance(manifest, dict) else {}
    if not recorded:  # saved before sizes were recorded: nothing to compare
        return None
    present = location.file_sizes(tag)
    for name, size in sorted(recorded.items()):
        if name not in present:
            return f"its file {name} is missing"
        if present[name] != size:
            return f"its file {name} is {present[name]} bytes, {size} when it was saved"
    return None


def committed_tags(location: Location) -> list[str]:
    """Checkpoints under ``location`` that were completed (intact or not), oldest first."""
    found = []
    for name in location.children():
        if not name.startswith(".") and name != NEWEST and location.exists(name, MANIFEST):
            try:
                found.append((location.read_json(name, MANIFEST)["saved_at"], name))
            except (ValueError, KeyError, TypeError):
                continue
    return [name for _, name in sorted(found)]


def intact_tags(location: Location) -> list[str]:
    """Completed checkpoints under ``location`` whose files are as saved, oldest first."""
    return [tag for tag in committed_tags(location) if damage(location, tag) is None]


def newest(path: str | os.PathLike, *, required: bool = False) -> str | None:
    """The tag of the newest intact checkpoint under ``path``, or None if there is none
    (a CheckpointError instead when ``required``). When the checkpoint named newest is
    damaged or gone, the newest intact one is chosen, and rank 0 logs one line (a
    CheckpointError when there is none)."""
    location = Location(path)
    if not location.exists(NEWEST):
        if required:
            raise CheckpointError(f"no checkpoint to resume from at {os.fspath(path)!r}: it has "
                                  f"no '{NEWEST}' file (no checkpoint was completed there); "
                                  f"check the path, or start from scratch")
        return None
    tag = location.read_text(NEWEST).strip()
    problem = damage(location, tag)
    if problem is None:
        return tag
    intact = intact_tags(location)
    if not intact:
        raise CheckpointError(f"{location.url(NEWEST)} names checkpoint {tag!r}, but "
                              f"{problem}; no intact checkpoint is left under "
                              f"{os.fspath(path)!r}. Remove it (and the '{NEWEST}' file) to "
                              f"start from scratch")
    if not dist.is_initialized() or dist.get_rank() == 0:
        what = f"is damaged ({problem})" if location.exists(tag) else "does not exist"
        logger.warning("checkpoint %s %s; using %s, the newest intact one",
                       location.url(tag), what, location.url(intact[-1]))
    return intact[-1]


def read_manifest(location: Location, tag: str, format_name: str) -> dict[str, Any]:
    """``location/tag``'s manifest; a CheckpointError naming the tag as damaged, with
    the intact tags, unless it is intact and of ``format_name``."""
    if not location.exists(tag):
        raise CheckpointError(f"checkpoint {location.url(tag)} does not exist; complete "
                              f"checkpoints there: {intact_tags(location) or 'none'}")
    if not location.exists(tag, MANIFEST):
        raise CheckpointError(f"{location.url(tag)} is not a complete checkpoint (no "
                              f"{MANIFEST}); complete checkpoints there: "
                              f"{intact_tags(location) or 'none'}")
    problem = damage(location, tag)
    if problem is not None:
        others = [t for t in intact_tags(location) if t != tag]
        fix = f"resume from a complete one ({others}) with tag=, or remove it" if others \
            else "no complete checkpoint is left there: remove it to start from scratch"
        raise CheckpointError(f"checkpoint {location.url(tag)} is damaged: {problem}; {fix}")
    manifest = location.read_json(tag, MANIFEST)
    if manifest.get("format") != format_name:
        raise CheckpointError(f"{location.url(tag)} is not a modelparallel checkpoint "
                              f"(format {manifest.get('format')!r})")
    return manifest
