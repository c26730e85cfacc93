"""Every SMP / SMDDP name resolves through both mappings, as docs/smp-compatibility.md
and the names public code uses (tests/data/smp_public_names.json) say.

The import line rewrites SageMaker's module paths to modelparallel's; zero lines
imports them as they are with ``MODELPARALLEL_COMPAT=sagemaker``. A name is looked up
without running anything: its longest importable module, then attributes (statically
on objects, so ``tsm.state.world_size`` needs no ``init()``; a property's return type
is followed), and for ``f(arg=)`` that ``f`` declares ``arg``.
"""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "smp-compatibility.md"
PUBLIC = REPO / "tests" / "data" / "smp_public_names.json"

# The import-line port (README): SageMaker's module path prefix -> modelparallel's.
IMPORT_LINE = [
    ("smdistributed.dataparallel.torch.parallel.distributed", "modelparallel.dataparallel"),
    ("smdistributed.dataparallel.torch.parallel", "modelparallel.dataparallel"),
    ("smdistributed.dataparallel.torch.distributed", "modelparallel.dataparallel"),
    ("smdistributed.dataparallel.torch.torch_smddp", "modelparallel.dataparallel"),
    ("smdistributed.modelparallel.torch", "modelparallel"),
    ("smdistributed.modelparallel.test.torch.utils", "modelparallel.test.torch.utils"),
    ("smdistributed.modelparallel", "modelparallel"),
    ("torch.sagemaker", "modelparallel"),
]

LOOKUP = r'''
import importlib, inspect, json, re, sys, types, typing

def assigned_in_init(cls, attr):
    """Whether some class of ``cls``'s MRO sets ``self.<attr>`` in ``__init__``."""
    for klass in getattr(cls, "__mro__", ()):
        init = klass.__dict__.get("__init__")
        try:
            source = inspect.getsource(init) if init is not None else ""
        except (OSError, TypeError):
            continue
        if re.search(rf"self\.{attr}\s*(:[^=]*)?=", source):
            return True
    return False

def static(obj, attr):
    if isinstance(obj, types.ModuleType):
        return getattr(obj, attr)
    if inspect.isfunction(obj):  # a factory (DistributedDataParallel): what it returns
        hint = typing.get_type_hints(obj).get("return")
        for kind in typing.get_args(hint) or (hint,):  # any type of a union may have it
            if isinstance(kind, type) and hasattr(kind, attr):
                return getattr(kind, attr)
            if isinstance(kind, type) and assigned_in_init(kind, attr):
                return object()
    try:
        value = inspect.getattr_static(obj, attr)
    except AttributeError:
        if isinstance(obj, type) and assigned_in_init(obj, attr):
            return object()
        raise
    if isinstance(value, property):
        hint = typing.get_type_hints(value.fget).get("return")
        return hint if isinstance(hint, type) else object()
    return value

def lookup(dotted):
    name, _, kwarg = dotted.partition("(")
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:end]))
            break
        except ImportError as e:
            error = e
    else:
        raise error
    for attr in parts[end:]:
        obj = static(obj, attr)
    kwarg = kwarg.rstrip("=)")
    if kwarg and kwarg not in inspect.signature(obj).parameters:
        raise TypeError(f"{name} takes no argument {kwarg!r}")

out = {}
for dotted in json.load(sys.stdin):
    try:
        lookup(dotted)
        out[dotted] = None
    except Exception as e:
        out[dotted] = f"{type(e).__name__}: {e}"
print(json.dumps(out))
'''


def import_line(name: str) -> str:
    for old, new in IMPORT_LINE:
        if name == old or name.startswith(old + ".") or name.startswith(old + "("):
            return new + name[len(old):]
    raise AssertionError(f"{name} is not under a SageMaker module path")


def lookup_all(names: list[str]) -> dict[str, str | None]:
    """name -> None when it resolves, else the error (one interpreter, compat on)."""
    env = {**os.environ, "MODELPARALLEL_COMPAT": "sagemaker"}
    done = subprocess.run([sys.executable, "-c", LOOKUP], input=json.dumps(names),
                          capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


ROW = re.compile(r"^\| `([^`]+)` \| (\w[\w ,]*?) \|")
STATUSES = {"works", "differs", "no effect", "refused", "not provided"}


def doc_rows() -> list[tuple[str, str]]:
    rows = []
    for line in DOC.read_text().splitlines():
        found = ROW.match(line)
        if found and found.group(1).startswith(("smdistributed", "torch.sagemaker")):
            rows.append((found.group(1), found.group(2)))
    return rows


def test_the_compatibility_table_tells_the_truth():
    rows = doc_rows()
    assert len(rows) > 150, "the table lost its rows"
    assert {status for _, status in rows} <= STATUSES
    names = [n for n, _ in rows]
    found = lookup_all(names + [import_line(n) for n in names])
    wrong = []
    for name, status in rows:
        for way in (name, import_line(name)):
            error = found[way]
            if status == "not provided" and error is None:
                wrong.append(f"{way}: listed as not provided, but it resolves")
            elif status != "not provided" and error is not None:
                wrong.append(f"{way}: listed as {status}, but {error}")
    assert not wrong, "\n".join(wrong)


def test_every_name_public_code_uses_resolves_both_ways():
    if not PUBLIC.exists():
        pytest.fail(f"{PUBLIC} is missing")
    entries = json.loads(PUBLIC.read_text())
    names = sorted({e["name"] + (f"({e['kwarg']}=)" if e.get("kwarg") else "")
                    for e in entries})
    not_provided = {n for n, status in doc_rows() if status == "not provided"}
    found = lookup_all(names + [import_line(n) for n in names])
    wrong = [f"{way}: {found[way]}" for n in names if n not in not_provided
             for way in (n, import_line(n)) if found[way] is not None]
    assert not wrong, "\n".join(wrong)
