"""SMP v1's ``smp.save`` / ``smp.load``: ``torch.save`` / ``torch.load`` with one file
per model part.

``partial=True``: each rank writes ``f"{f}_{pp_rank}_{tp_rank}"`` (``v3=True``:
``f"{f}_{pp_rank}_{tp_rank}_{rdp_rank}"``, for a sharded optimizer state) and reads
back its own; ``partial=False``: rank 0 writes ``f`` and every rank reads it. The names
are SMP's (its source appends the ranks to ``f`` as given, so ``"ckpt.pt"`` becomes
``"ckpt.pt_0_1"``); older SMP's ``f"{f}_{mp_rank}"`` files load with
``back_compat=True``. Neither call is collective (scripts call ``smp.save`` on
``rdp_rank() == 0`` only): call ``smp.barrier()`` between saving on some ranks and
loading on others. Writes go to a temporary file renamed into place, so ranks that
write the same part (replicas) never leave a torn file.

The manual checkpoint pattern::

    if smp.rdp_rank() == 0:
        smp.save({"model": model.local_state_dict(),
                  "optimizer": optimizer.local_state_dict()}, "ckpt.pt", partial=True)
    full = model.state_dict()                       # collective
    if smp.rank() == 0:
        smp.save(full, "model.pt", partial=False)
    smp.barrier()
    part = smp.load("ckpt.pt")                      # any rank, before or after the split
    model.load_state_dict(part["model"])
    optimizer.load_state_dict(part["optimizer"])

``smp.load`` uses ``torch.load``, whose ``weights_only`` default (torch >= 2.6) reads
tensors, numbers, strings and containers without running code from the file.
"""

from __future__ import annotations

import glob
import os
import pickle
import re
import tempfile
from typing import IO, Any

import torch

from modelparallel.smp.state import state
from modelparallel.topology import CommGroup

_TEMPORARY = ".sagemaker-"  # SageMaker's upload temporaries: never a part


def _coordinates() -> dict[str, int]:
    s = state.require("smp.save / smp.load").context
    t = s.topology
    groups = {"pp": CommGroup.PP_GROUP, "tp": CommGroup.TP_GROUP, "rdp": CommGroup.RDP_GROUP,
              "mp": CommGroup.MP_GROUP}
    return {"rank": s.rank, **{k: t.rank_in(s.rank, g) for k, g in groups.items()}}


def part_name(f: str | os.PathLike, v3: bool = False) -> str:
    """The file this rank's part of ``f`` is saved to."""
    c = _coordinates()
    name = f"{os.fspath(f)}_{c['pp']}_{c['tp']}"
    return f"{name}_{c['rdp']}" if v3 else name


def save(obj: Any, f: str | os.PathLike, partial: bool = True,
         pickle_module: Any = pickle, pickle_protocol: int = 2, v3: bool = False,
         **kwargs: Any) -> None:
    """``torch.save(obj, ...)`` to this rank's part file (``partial=True``) or, on rank
    0 only, to ``f`` (``partial=False``). Not collective."""
    if not isinstance(f, (str, os.PathLike)):
        raise TypeError(f"smp.save needs a file name (str), got {type(f).__name__}: it "
                        f"appends the ranks to it")
    c = _coordinates()
    if not partial and c["rank"] != 0:
        return
    target = part_name(f, v3) if partial else os.fspath(f)
    directory = os.path.dirname(os.path.abspath(target))
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(target)}.", suffix=".tmp",
                               dir=directory)
    try:
        with os.fdopen(fd, "wb") as out:
            torch.save(obj, out, pickle_module=pickle_module, pickle_protocol=pickle_protocol,
                       **kwargs)
        os.replace(tmp, target)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def load(f: str | os.PathLike | IO[bytes], map_location: Any = None, pickle_module: Any = None,
         partial: bool = True, back_compat: bool = False, **pickle_load_args: Any) -> Any:
    """``torch.load`` of this rank's part of ``f`` (``partial=True``: the parts are
    checked against the layout first) or of ``f`` itself. Not collective."""
    if partial:
        if not isinstance(f, (str, os.PathLike)):
            raise TypeError(f"smp.load(partial=True) needs the file name the parts were "
                            f"saved under (str), got {type(f).__name__}")
        f = _own_part(os.fspath(f), back_compat)
    if pickle_module is not None:
        pickle_load_args["pickle_module"] = pickle_module
    return torch.load(f, map_location=map_location, **pickle_load_args)


def _own_part(prefix: str, back_compat: bool) -> str:
    s = state.require("smp.load").context
    t = s.topology
    parts = [p for p in glob.glob(f"{glob.escape(prefix)}_*")
             if _TEMPORARY not in p and not os.path.basename(p).startswith(".")]
    found: dict[int, list[tuple[int, ...]]] = {1: [], 2: [], 3: []}
    tail = re.compile(re.escape(prefix) + r"((?:_\d+){1,3})$")
    for path in parts:
        m = tail.match(path)
        if m:
            numbers = tuple(int(x) for x in m.group(1).split("_")[1:])
            found[len(numbers)].append(numbers)
    c = _coordinates()
    pp, tp, rdp = (t.size_of(g) for g in (CommGroup.PP_GROUP, CommGroup.TP_GROUP,
                                          CommGroup.RDP_GROUP))
    layouts = {3: ((pp, tp, rdp), (c["pp"], c["tp"], c["rdp"]), "{}_{}_{}_{}"),
               2: ((pp, tp), (c["pp"], c["tp"]), "{}_{}_{}"),
               1: ((pp * tp,), (c["mp"],), "{}_{}")}
    kinds = [k for k in (3, 2) if found[k]] or ([1] if back_compat and found[1] else [])
    if not kinds:
        hint = (" (files named f'{prefix}_{mp_rank}' were written by SMP before v1.6: load "
                "them with back_compat=True)" if found[1] else "")
        raise FileNotFoundError(f"no partial checkpoint files {prefix}_<pp_rank>_<tp_rank> "
                                f"found{hint}; was it saved with partial=False? then load "
                                f"it with partial=False")
    kind = kinds[0]
    sizes, mine, pattern = layouts[kind]
    expected = {tuple(i) for i in _grid(sizes)}
    have = set(found[kind])
    if have != expected:
        what = {3: "pipeline x tensor-parallel x reduced-data-parallel ranks",
                2: "pipeline x tensor-parallel ranks", 1: "model-parallel ranks"}[kind]
        raise RuntimeError(
            f"cannot load the {len(have)}-part checkpoint {prefix!r} into "
            f"{' x '.join(map(str, sizes))} {what}: expected parts {sorted(expected)}, "
            f"found {sorted(have)}. A partial "
            f"checkpoint loads into the layout that saved it; save the full model "
            f"(model.state_dict() with partial=False) to change the layout")
    return pattern.format(prefix, *mine)


def _grid(sizes: tuple[int, ...]) -> list[list[int]]:
    out: list[list[int]] = [[]]
    for n in sizes:
        out = [[*o, i] for o in out for i in range(n)]
    return out


__all__ = ["load", "part_name", "save"]
