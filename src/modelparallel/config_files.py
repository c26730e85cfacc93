"""Configuration files: JSON or YAML, with or without SageMaker's wrapper."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from modelparallel.errors import ConfigError


def read_config_file(path: str | os.PathLike) -> dict[str, Any]:
    """Read a JSON or YAML configuration file (by extension; otherwise JSON, then YAML).

    SageMaker's ``{"enabled": ..., "parameters": {...}}`` wrapper is removed.
    """
    p = Path(path)
    if not p.is_file():
        raise ConfigError([("configuration", f"file {str(p)!r} does not exist")])
    text = p.read_text()
    try:
        if p.suffix.lower() in (".yaml", ".yml"):
            data = _yaml_load(text)
        else:
            try:
                data = json.loads(text)
            except json.JSONDecodeError:
                if p.suffix.lower() == ".json":
                    raise
                data = _yaml_load(text)
    except Exception as e:
        raise ConfigError([("configuration", f"cannot parse {_where(p, e)}: "
                                             f"{_parse_problem(e)}")]) from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError([("configuration", f"{str(p)!r} holds a {type(data).__name__}; "
                                             f"expected a mapping of keys to values")])
    return unwrap(data)


def _where(path: Path, error: Exception) -> str:
    """The file, and the line and column a JSON or YAML parser stopped at."""
    mark = getattr(error, "problem_mark", None)  # YAML's
    if mark is not None:
        return f"{str(path)!r}, line {mark.line + 1}, column {mark.column + 1}"
    if isinstance(error, json.JSONDecodeError):
        return f"{str(path)!r}, line {error.lineno}, column {error.colno}"
    return repr(str(path))


def _parse_problem(error: Exception) -> str:
    """What the parser found wrong, without its own idea of where (it names no file)."""
    if isinstance(error, json.JSONDecodeError):
        return error.msg
    problem = getattr(error, "problem", None)
    if problem is None:
        return str(error)
    context = getattr(error, "context", None)
    return f"{problem} ({context})" if context else str(problem)


def _yaml_load(text: str) -> Any:
    import yaml

    return yaml.safe_load(text)


def unwrap(data: dict[str, Any]) -> dict[str, Any]:
    """Accept SageMaker's ``{"enabled": True, "parameters": {...}}`` wrapper too."""
    if set(data) <= {"enabled", "parameters"} and isinstance(data.get("parameters"), dict):
        return dict(data["parameters"])
    return data


def read_source(source: Mapping[str, Any] | str | os.PathLike | None) -> dict[str, Any]:
    """A script's configuration as a dict: a mapping, a JSON/YAML file path, or None."""
    if source is None:
        return {}
    if isinstance(source, Mapping):
        return unwrap(dict(source))
    if isinstance(source, (str, os.PathLike)):
        return unwrap(read_config_file(source))
    raise ConfigError([("configuration", f"cannot read a configuration from a "
                                         f"{type(source).__name__}; pass a dict, a path to "
                                         f"a JSON or YAML file, or None")])


def read_launcher_config(environ: Mapping[str, str]) -> dict[str, Any]:
    """The launcher's configuration (a JSON object) from ``environ``; {} when unset.

    ``MP_CONFIG`` is modelparallel's launcher's; ``SM_HP_MP_PARAMETERS`` is what
    SageMaker sets from the estimator's ``distribution`` (SMP reads it the same way:
    over the script's configuration). Both set: they must agree on every key.
    """
    launcher: dict[str, Any] = {}
    for name in ("SM_HP_MP_PARAMETERS", "MP_CONFIG"):
        found = _read_json_object(environ, name)
        clash = {k for k in found.keys() & launcher.keys() if found[k] != launcher[k]}
        if clash:
            raise ConfigError([(k, f"SM_HP_MP_PARAMETERS says {launcher[k]!r} but MP_CONFIG "
                                   f"says {found[k]!r}; set it in one of them")
                               for k in sorted(clash)])
        launcher |= found
    return launcher


def _read_json_object(environ: Mapping[str, str], name: str) -> dict[str, Any]:
    text = environ.get(name)
    if not text:
        return {}
    try:
        launcher = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError([(name, f"is not valid JSON ({e})")]) from None
    if not isinstance(launcher, dict):
        kind = {list: "an array", str: "a string", bool: "a boolean",
                type(None): "null"}.get(type(launcher), "a number")
        raise ConfigError([(name, f"holds {kind}; expected a JSON object "
                                  f"of keys to values")])
    return unwrap(launcher)
