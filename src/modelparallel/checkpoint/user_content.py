"""What SMP scripts keep in a checkpoint's ``user_content``, stored so that loading it
never runs code the checkpoint names.

Checkpoints are read with ``torch.load(weights_only=True)``, which refuses arbitrary
classes. Values scripts commonly store that are not plain data are turned into plain
data on save and back on load: NumPy arrays (numeric: a tensor; strings: a list) and
scalars (``np.float32(0.5)``), and Hugging Face configuration objects (their
``to_dict()``; rebuilt only as a ``transformers`` configuration class, so a checkpoint
cannot choose other code to import). Anything else that is not plain data is refused
with the name of its type when saving.
"""

from __future__ import annotations

import importlib
from typing import Any

import numpy as np
import torch

MARK = "__modelparallel_user_content__"


def encode(value: Any) -> Any:
    """``value`` with NumPy values and Hugging Face configs replaced by plain data."""
    if isinstance(value, dict):
        return {k: encode(v) for k, v in value.items()}
    if isinstance(value, list):
        return [encode(v) for v in value]
    if isinstance(value, tuple) and not hasattr(value, "_fields"):
        return tuple(encode(v) for v in value)
    if isinstance(value, np.ndarray):
        if value.dtype.kind in "biufc":
            return {MARK: "numpy.ndarray", "dtype": value.dtype.str,
                    "data": torch.from_numpy(np.ascontiguousarray(value).copy())}
        if value.dtype.kind in "US":
            return {MARK: "numpy.ndarray", "dtype": value.dtype.str, "list": value.tolist()}
        return value  # object arrays: refused by the caller's check, with their type
    if isinstance(value, np.generic):
        return {MARK: "numpy.scalar", "dtype": value.dtype.str, "value": value.item()}
    config_class = _hf_config_class(type(value))
    if config_class is not None:
        return {MARK: "transformers.config", "class": config_class,
                "dict": encode(value.to_dict())}
    return value


def decode(value: Any) -> Any:
    """The inverse of :func:`encode`."""
    if isinstance(value, dict):
        kind = value.get(MARK)
        if kind == "numpy.ndarray":
            dtype = np.dtype(value["dtype"])
            if "data" in value:
                return value["data"].numpy().astype(dtype, copy=False)
            return np.array(value["list"], dtype=dtype)
        if kind == "numpy.scalar":
            return np.dtype(value["dtype"]).type(value["value"])
        if kind == "transformers.config":
            return _hf_config(value["class"], decode(value["dict"]))
        return {k: decode(v) for k, v in value.items()}
    if isinstance(value, list):
        return [decode(v) for v in value]
    if isinstance(value, tuple):
        return tuple(decode(v) for v in value)
    return value


def _hf_config_class(cls: type) -> str | None:
    """``module.Class`` of a Hugging Face configuration class, else None."""
    if not cls.__module__.startswith("transformers."):
        return None
    try:
        from transformers import PretrainedConfig
    except ImportError:
        return None
    return f"{cls.__module__}.{cls.__qualname__}" if issubclass(cls, PretrainedConfig) \
        else None


def _hf_config(path: str, data: dict[str, Any]) -> Any:
    module_name, _, name = path.rpartition(".")
    if not module_name.startswith("transformers."):
        raise ValueError(f"user_content names {path!r}, which is not a transformers class")
    from transformers import PretrainedConfig

    cls = getattr(importlib.import_module(module_name), name, None)
    if not (isinstance(cls, type) and issubclass(cls, PretrainedConfig)):
        raise ValueError(f"user_content names {path!r}, which is not a Hugging Face "
                         f"configuration class")
    return cls.from_dict(data)
