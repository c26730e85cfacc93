"""Configuration files: JSON or YAML, with or without SageMaker's wrapper."""

from __future__ import annotations

import json
import os
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
        raise ConfigError([("configuration", f"cannot parse {str(p)!r}: {e}")]) from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError([("configuration", f"{str(p)!r} holds a {type(data).__name__}; "
                                             f"expected a mapping of keys to values")])
    return unwrap(data)


def _yaml_load(text: str) -> Any:
    import yaml

    return yaml.safe_load(text)


def unwrap(data: dict[str, Any]) -> dict[str, Any]:
    """Accept SageMaker's ``{"enabled": True, "parameters": {...}}`` wrapper too."""
    if set(data) <= {"enabled", "parameters"} and isinstance(data.get("parameters"), dict):
        return dict(data["parameters"])
    return data
