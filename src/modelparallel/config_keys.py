"""How a configuration key is declared, checked and read (``Config``'s fields use these)."""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Mapping
from dataclasses import field
from typing import Any

from modelparallel.errors import ConfigError


def key(default: Any, doc: str, *, minimum: float | None = None,
         maximum: float | None = None, choices: tuple | None = None,
         kind: type | tuple[type, ...] | None = None, no_effect: str | None = None,
         not_built: str | None = None) -> Any:
    """Declare one configuration key: its default, meaning and valid range.

    ``no_effect``: why the key, accepted for compatibility, does nothing here (it only
    tunes mechanics PyTorch handles itself); a value other than the default is logged
    once on rank 0 with this reason. ``not_built``: why only the default is accepted
    (a feature not provided yet); any other value is a ConfigError. Every other key
    does what SMP documents.
    """
    for reason in (no_effect, not_built):
        assert reason is None or (reason.strip() and "\n" not in reason), reason
    assert not (no_effect and not_built), "a key is either without effect or refused"
    meta = {"doc": doc, "min": minimum, "max": maximum, "choices": choices,
            "kind": kind, "no_effect": no_effect, "not_built": not_built}
    return field(default=default, metadata=meta)


def check_value(f: dataclasses.Field, value: Any) -> str | None:
    meta = f.metadata
    kind = meta["kind"] or _annotation_kind(f)
    if value is None:
        return None if f.default is None else f"must not be null; default is {f.default!r}"
    if isinstance(value, bool) and kind is not bool:
        return f"{value!r} has type bool; expected {_kind_name(kind)}"
    if not isinstance(value, kind):
        return f"{value!r} has type {type(value).__name__}; expected {_kind_name(kind)}"
    if meta["choices"] and value not in meta["choices"]:
        valid = ", ".join(repr(c) for c in meta["choices"])
        return f"{value!r} is not one of {valid}"
    lo, hi = meta["min"], meta["max"]
    if lo is not None and value < lo:
        return f"{value!r} is out of range; must be >= {lo}" + (f" and <= {hi}" if hi else "")
    if hi is not None and value > hi:
        return f"{value!r} is out of range; must be <= {hi}" + (
            f" and >= {lo}" if lo is not None else "")
    return None


def _annotation_kind(f: dataclasses.Field) -> type:
    name = str(f.type).split("|")[0].strip()
    return {"int": int, "str": str, "bool": bool, "float": float}[name]


def _kind_name(kind: type | tuple[type, ...]) -> str:
    if isinstance(kind, tuple):
        return " or ".join(k.__name__ for k in kind)
    return kind.__name__


def normalise(data: dict[str, Any], origin: str, fields: Mapping[str, dataclasses.Field],
              aliases: Mapping[str, str],
              problems: list[tuple[str, str]] | None = None) -> dict[str, Any]:
    """Resolve aliases, reject unknown keys with suggestions, coerce integral floats.

    With a ``problems`` list, unknown and conflicting keys are added to it and left out
    of the result (so the caller can report them beside the other problems); without
    one they raise a ConfigError.
    """
    names = list(fields)
    collect = problems is not None
    problems = problems if problems is not None else []
    out: dict[str, Any] = {}
    given_as: dict[str, str] = {}  # canonical name -> the key it was first given as
    for key, value in data.items():
        name = aliases.get(key, key)
        if name not in names:
            close = difflib.get_close_matches(key, [*names, *aliases], n=3, cutoff=0.6)
            hint = f"did you mean {' or '.join(repr(c) for c in close)}?" if close else \
                "see `modelparallel check-config --list` for the valid keys"
            problems.append((key, f"unknown key in {origin}; {hint}"))
            continue
        if name in out and out[name] != value:
            first = given_as[name]
            alias = key if key in aliases else first
            problems.append((key, f"{value!r} conflicts with {first}={out[name]!r} "
                                  f"({alias} is an alias of {name}); set only one"))
            continue
        given_as.setdefault(name, key)
        out[name] = _coerce(fields[name], value)
    if problems and not collect:
        raise ConfigError(problems)
    return out


def _coerce(f: dataclasses.Field, value: Any) -> Any:
    # JSON writes large integers as 5e8; accept integral floats for integer keys.
    if isinstance(value, float) and value.is_integer() and str(f.type).startswith("int"):
        return int(value)
    return value
