"""Delayed parameter initialization: SMP v2's ``torch.sagemaker.delayed_param`` and
``torch.sagemaker.utils.module_utils``, SMP v1's ``smp.delay_param_initialization`` and
``smp.model_creation``.

SMP v2: build the model with its parameters on the meta device, then let the sharding
wrapper allocate and initialise it unit by unit::

    with torch.device("meta"):          # or accelerate / our init_empty_weights()
        model = create_model()
    initer = DelayedParamIniter(model)
    with initer.validate_params_and_buffers_inited():
        model = FSDP(model, ..., param_init_fn=initer.get_param_init_fn(),
                     post_param_init_fn=initer.get_post_param_init_fn())
    # or: model = mp.shard(model, param_init_fn=initer.get_param_init_fn())

SMP v1: modules created inside ``delay_param_initialization()`` (or ``model_creation()``
with ``delayed_parameter_initialization: True``) record their initialisation; the
``DistributedModel`` allocates and initialises only what the rank holds, at its first
step (:mod:`modelparallel.parallel.deferred`).
"""

from __future__ import annotations

import contextlib
import logging
import weakref
import zlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from modelparallel.module_state import lookup
from modelparallel.parallel import deferred, delayed_init
from modelparallel.parallel.delayed_init import init_empty_weights
from modelparallel.parallel.expert_parallel.hugging_face import is_experts_module
from modelparallel.parallel.placement import is_meta
from modelparallel.smp.state import state
from modelparallel.smp.v1 import tensor_parallelism as tp_marking

logger = logging.getLogger("modelparallel")

__all__ = ["DelayedParamIniter", "delay_param_initialization", "empty_module_params",
           "init_empty_weights", "model_creation", "move_buffers_to_device"]

_NORMS = ("LayerNorm", "RMSNorm", "GroupNorm")  # class-name endings: weight 1, bias 0


def _device(device: torch.device | str | None = None) -> torch.device:
    """``device``, else the device of the current ``mp.init()``, else the current CUDA
    device, else the CPU (SMP initialises on ``torch.cuda.current_device()``)."""
    if device is not None:
        return torch.device(device)
    ctx = state.context_or_none()
    return ctx.device if ctx is not None else delayed_init.default_device()


def empty_module_params(module: nn.Module, device: torch.device | str | None = None,
                        recurse: bool = False) -> None:
    """SMP v2's ``module_utils.empty_module_params``: the module's meta parameters become
    uninitialised tensors on ``device`` (default: this rank's device)."""
    delayed_init.empty_module_params(module, _device(device), recurse)


def move_buffers_to_device(module: nn.Module, device: torch.device | str | None = None,
                           recurse: bool = False) -> None:
    """SMP v2's ``module_utils.move_buffers_to_device`` (a meta buffer is an error)."""
    delayed_init.move_buffers_to_device(module, _device(device), recurse)


def _tie_weights(module: nn.Module) -> None:
    tie = getattr(module, "tie_weights", None)
    if callable(tie):
        tie()


class DelayedParamIniter:
    """SMP v2's ``torch.sagemaker.delayed_param.DelayedParamIniter``.

    ``get_param_init_fn()`` gives FSDP's ``param_init_fn``: it allocates one module's own
    meta parameters (not its children's) on this rank's device and initialises them:
    with ``init_method_using_config(module)`` when given, else by type — ``nn.Linear``,
    Hugging Face ``Conv1D`` and ``nn.Embedding`` weights from N(0, ``initializer_range``
    of the model's ``config``, else 0.02) with a zero padding row, biases 0, layer and
    RMS norm weights 1, a mixture-of-experts layer's fused expert weights (Mixtral's,
    Qwen-MoE's ``gate_up_proj`` and ``down_proj``) and its router's (``...TopKRouter``)
    from N(0, ``initializer_range``); a module of another type uses its
    ``reset_parameters()``, or is an error naming it. Buffers are moved to the device.
    Tied parameters stay tied.

    Each parameter draws from its own random stream, seeded from ``torch.initial_seed()``
    at construction and the parameter's name: values do not depend on the order FSDP
    visits modules nor on the shard degree, and one process initialising every module
    gets the same model. Every rank must seed alike (as SMP scripts do), or pass FSDP
    ``sync_module_states=True`` (``mp.shard`` always starts from the first rank's).
    """

    def __init__(self, model: nn.Module,
                 init_method_using_config: Callable[[nn.Module], Any] | None = None,
                 verbose: bool = False):
        if init_method_using_config is not None and not callable(init_method_using_config):
            raise TypeError(f"init_method_using_config must be callable, got "
                            f"{init_method_using_config!r}")
        self.model = model
        self.init_method_using_config = init_method_using_config
        self.verbose = verbose
        self.seed = torch.initial_seed()
        config = getattr(model, "config", None)
        self.initializer_range = float(getattr(config, "initializer_range", 0.02) or 0.02)
        # id -> (the parameter, weakly: ids of freed ones get reused; its first name; every
        # (module, name) holding it)
        self._params: dict[int, tuple[weakref.ref, str, list[tuple[nn.Module, str]]]] = {}
        holders = delayed_init.owners(model)
        for name, p in model.named_parameters(remove_duplicate=False):
            if id(p) not in self._params:  # a tied parameter: its first name
                self._params[id(p)] = (weakref.ref(p), name, holders[id(p)])
        self._module_names = {id(m): n for n, m in model.named_modules()}

    # -- SMP's methods -----------------------------------------------------------------
    def get_param_init_fn(self) -> Callable[[nn.Module], None]:
        """FSDP's ``param_init_fn`` (also ``mp.shard(param_init_fn=...)``)."""
        return self._init_module

    def get_post_param_init_fn(self) -> Callable[[nn.Module], None]:
        """FSDP's ``post_param_init_fn``: ``module.tie_weights()`` when it has one."""
        return _tie_weights

    def count_num_params(self, module: nn.Module, *args: Any) -> int:
        """Number of parameter elements of ``module.parameters(*args)`` (meta included)."""
        return sum(p.numel() for p in module.parameters(*args))

    @contextlib.contextmanager
    def validate_params_and_buffers_inited(self, enabled: bool = True) -> Iterator[None]:
        """On leaving, check that no parameter or buffer of the model is still on the meta
        device (every one was initialised); ``enabled=False`` skips the check."""
        yield
        if not enabled:
            return
        left = [n for n, t in [*self.model.named_parameters(), *self.model.named_buffers()]
                if is_meta(t)]
        if left:
            raise RuntimeError(f"{len(left)} parameters or buffers are still on the meta "
                               f"device (not initialised): {left[:10]}")

    # -- the init function -------------------------------------------------------------
    def _init_module(self, module: nn.Module) -> None:
        device = _device()
        own = {n: p for n, p in module._parameters.items() if p is not None and is_meta(p)}
        if self.init_method_using_config is not None:
            delayed_init.empty_module_params(module, device)
            with self._stream(self._module_names.get(id(module), type(module).__name__)):
                self.init_method_using_config(module)
            self._retie(own, module)
        elif own and not _known(module):
            reset = getattr(module, "reset_parameters", None)
            if not callable(reset):
                raise ValueError(
                    f"DelayedParamIniter does not know how to initialise {type(module).__name__} "
                    f"(parameters {sorted(own)}): pass init_method_using_config=fn, where "
                    "fn(module) initialises a module's own parameters")
            delayed_init.empty_module_params(module, device)
            with self._stream(self._module_names.get(id(module), type(module).__name__)), \
                    torch.no_grad():
                reset()
            self._retie(own, module)
        else:
            for name, p in own.items():
                self._replace(p, self._build(module, name, p, device), module, name)
        delayed_init.move_buffers_to_device(module, device)
        if self.verbose and own:
            logger.info("DelayedParamIniter: initialised %s (%s, %d parameters) on %s",
                        self._module_names.get(id(module), "?"), type(module).__name__,
                        sum(p.numel() for p in own.values()), device)

    def _known_param(self, p: torch.Tensor, module: nn.Module,
                     name: str) -> tuple[str, list[tuple[nn.Module, str]]]:
        """The first name of ``p`` and its holders (a stand-in for a split parameter is
        new: it is named by ``module`` and held by it alone)."""
        entry = self._params.get(id(p))
        if entry is not None and entry[0]() is p:
            return entry[1], entry[2]
        prefix = self._module_names.get(id(module), type(module).__name__)
        return (f"{prefix}.{name}" if prefix else name), [(module, name)]

    def _build(self, module: nn.Module, name: str, p: torch.Tensor,
               device: torch.device) -> nn.Parameter:
        key, holders = self._known_param(p, module, name)
        holder, attr = holders[0]  # the module of its first name
        if not _known(holder):
            holder, attr = module, name
        value = torch.empty(p.shape, dtype=p.dtype, device=device)
        generator = torch.Generator(device=device)
        generator.manual_seed(_seed(self.seed, key))
        with torch.no_grad():
            if attr == "bias":
                value.zero_()
            elif type(holder).__name__.endswith(_NORMS):
                value.fill_(1.0)
            else:
                value.normal_(0.0, self.initializer_range, generator=generator)
                padding = getattr(holder, "padding_idx", None)
                if isinstance(holder, nn.Embedding) and padding is not None:
                    value[padding].zero_()
        if isinstance(p, DTensor):  # split by tsm.transform: this rank's part of the whole
            return nn.Parameter(distribute_tensor(value, p.device_mesh, p.placements,
                                                  src_data_rank=None),
                                requires_grad=p.requires_grad)
        return nn.Parameter(value, requires_grad=p.requires_grad)

    def _replace(self, old: torch.Tensor, new: nn.Parameter, module: nn.Module,
                 name: str) -> None:
        for holder, attr in self._known_param(old, module, name)[1]:
            if holder._parameters.get(attr) is old:
                holder._parameters[attr] = new

    def _retie(self, own: Mapping[str, torch.Tensor], module: nn.Module) -> None:
        for name, old in own.items():
            self._replace(old, module._parameters[name], module, name)  # type: ignore[arg-type]

    @contextlib.contextmanager
    def _stream(self, key: str) -> Iterator[None]:
        """The global random stream, seeded for ``key`` (for functions that use it)."""
        with torch.random.fork_rng(devices=[torch.cuda.current_device()]
                                   if torch.cuda.is_available() else []):
            torch.manual_seed(_seed(self.seed, key))
            yield


def _known(module: nn.Module) -> bool:
    # a mixture-of-experts layer's fused 3-D expert weights (whole, or this rank's when
    # expert parallelism split them) and its router's weight (Hugging Face's
    # MixtralTopKRouter, Qwen2MoeTopKRouter, ...): N(0, initializer_range), as Hugging Face's
    experts = is_experts_module(module) or lookup(module, "expert_parallel") is not None
    name = type(module).__name__
    return isinstance(module, (nn.Linear, nn.Embedding)) or experts or \
        name == "Conv1D" or name.endswith(_NORMS) or name.endswith("TopKRouter")


def _seed(base: int, key: str) -> int:
    return zlib.crc32(f"{base}/{key}".encode())


# -- SMP v1 ------------------------------------------------------------------------------

def delay_param_initialization(enabled: bool = True) -> contextlib.AbstractContextManager[None]:
    """SMP v1's ``smp.delay_param_initialization``: parameters of modules created inside
    are not allocated; their initialisation is recorded and replayed by the
    ``DistributedModel`` (or ``mp.shard``) on the part each rank holds."""
    return deferred.record(enabled)


@contextlib.contextmanager
def model_creation(tensor_parallelism: bool = False, dtype: torch.dtype | None = None,
                   fused_softmax: bool | None = None, fused_bias_gelu: bool | None = None,
                   attention_in_fp32: bool | None = None,
                   query_key_layer_scaling: bool | None = None,
                   fused_dropout: bool | None = None, flash_attention: bool | None = None,
                   fp32_residual_addition: bool | None = None,
                   distribute_embedding: bool | None = None, use_alibi: bool | None = None,
                   alibi_bias_max: int | None = None, zero_init: bool | None = None,
                   ) -> Iterator[None]:
    """SMP v1's ``smp.model_creation``: modules created inside are marked for tensor
    parallelism (``tensor_parallelism=True``; ``False`` leaves the built-in plans to
    decide), have their parameters' initialisation delayed when the configuration's
    ``delayed_parameter_initialization`` is true, and are created in ``dtype`` (the
    default floating type inside) when given. SMP's kernel options have no effect
    (one line says so: ``tp_marking``). Call after ``smp.init()``."""
    cfg = state.require("smp.model_creation()").context.config
    options = {k: v for k, v in locals().items() if k in tp_marking.OPTIONS}
    with contextlib.ExitStack() as stack:
        if tensor_parallelism:
            stack.enter_context(tp_marking.tensor_parallelism(True, **options))
        else:
            tp_marking.no_effect("smp.model_creation", options)
        stack.enter_context(deferred.record(cfg.delayed_parameter_initialization))
        if dtype is not None:
            previous = torch.get_default_dtype()
            torch.set_default_dtype(dtype)
            stack.callback(torch.set_default_dtype, previous)
        yield
