"""The configuration: every key of SMP v1 and v2, defaults, validation and loading.

All validation here is pure Python and runs on every rank before any collective, so
a bad configuration fails everywhere at once with the same message.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from modelparallel import config_keys, schedule_rules
from modelparallel.config_files import read_launcher_config, read_source
from modelparallel.errors import ConfigError
from modelparallel.notices import notice

logger = logging.getLogger("modelparallel")

ALIASES = {"partitions": "pipeline_parallel_degree"}
PLACEMENT_NAMES = {"cluster": "DPT", "spread": "TPD"}
_key = config_keys.key


@dataclass
class Config:
    """Every configuration key of SMP v1 (``modelparallel`` parameters) and SMP v2.

    Build it with :meth:`Config.load` (dict, JSON/YAML path, ``None``) so that
    aliases are resolved and every value is checked; ``topology.check_world`` adds the
    checks that need the world size.
    """

    # -- parallel degrees ------------------------------------------------------------
    tensor_parallel_degree: int = _key(1, "ranks a tensor-parallel module is split over", minimum=1)
    pipeline_parallel_degree: int = _key(
        1, "pipeline stages the model is split into (alias: partitions)", minimum=1)
    hybrid_shard_degree: int = _key(
        0, "0: shard over all data-parallel ranks; 1: no sharding; k>=2: shard over k "
           "ranks and replicate over the rest", minimum=0)
    sharded_data_parallel_degree: int = _key(
        1, "SMP v1 sharded data parallelism; k>=2 means hybrid_shard_degree=k", minimum=1)
    context_parallel_degree: int = _key(
        1, "ranks a sequence is split over (they shard the model together: a divisor of "
           "the shard degree)", minimum=1)
    expert_parallel_degree: int = _key(
        1, "data-parallel ranks the experts of each mixture-of-experts layer are split over "
           "(tokens travel to their experts by all-to-all; a divisor of the data-parallel "
           "size; tsm.transform with a MoEConfig)", minimum=1)
    placement_strategy: str = _key(
        "cluster", '"cluster" (= "DPT"), "spread" (= "TPD") or a permutation of D, P, T; '
                   "the right-most letter varies fastest over ranks")
    # -- pipeline --------------------------------------------------------------------
    microbatches: int = _key(1, "microbatches a batch is split into", minimum=1)
    pipeline: str = _key("interleaved", "pipeline schedule",
                         choices=schedule_rules.PIPELINE_SCHEDULES)
    virtual_stages: int | None = _key(
        None, "pipeline stages each rank holds (multi-stage schedules; default 2 for "
              "those, 1 otherwise)", minimum=1)
    active_microbatches: int | None = _key(
        None, "most microbatches in flight at once (simple and interleaved; default: "
              "as many as the schedule keeps)", minimum=1)
    auto_partition: bool = _key(True, "balance pipeline stages automatically")
    default_partition: int = _key(0, "stage for modules not placed explicitly", minimum=0)
    memory_weight: float | None = _key(
        None, "weight of memory vs compute balance in auto-partitioning "
              "(default 0.8, or 0.2 when optimize is speed)", minimum=0.0, maximum=1.0,
        kind=(int, float))
    optimize: str = _key("memory", "trade memory for speed in distributed modules",
                         choices=("memory", "speed"))
    contiguous: bool = _key(
        True, "pipeline stages are contiguous",
        no_effect="pipeline stages are always contiguous ranges of layers here")
    deterministic_server: bool = _key(
        False, "execute pipeline requests in the same order on every rank",
        no_effect="every rank runs the same static pipeline schedule, so requests are "
                  "always processed in the same order")
    skip_tracing: bool = _key(
        False, "skip the tracing step of auto-partitioning",
        no_effect="the automatic split needs one traced microbatch, which is cheap, so it "
                  "always traces")
    static_mode: bool = _key(
        False, "internal SMP v1 pipeline switch: skip the request/response exchange when "
               "steps do not change",
        no_effect="there is no request/response exchange to skip: every rank runs a fixed "
                  "torch.distributed.pipelining schedule each step")
    fast_mode: bool = _key(
        False, "internal SMP v1 pipeline switch: send tensors child-to-child instead of via "
               "the parent",
        no_effect="stages always send activations directly to the next stage "
                  "(torch.distributed.pipelining point-to-point); there is no parent relay")
    # -- data parallel ---------------------------------------------------------------
    ddp: bool = _key(False, "use DistributedDataParallel for the data-parallel dimension")
    ddp_port: int | None = _key(
        None, "port for the DDP process group", minimum=1, maximum=65535,
        no_effect="the default process group uses the launcher's rendezvous "
                  "(MASTER_ADDR/MASTER_PORT); data-parallel groups are sub-groups of it")
    overlapping_allreduce: bool = _key(
        True, "overlap the gradient all-reduce with the backward pass",
        no_effect="FSDP and DDP always overlap gradient reduction with the backward pass here")
    ddp_dist_backend: str = _key("auto", "process group backend",
                                 choices=("auto", "nccl", "gloo"))
    collective_timeout: float = _key(
        600, "seconds a collective may wait for the other ranks before it fails with an "
             "error (default group and every sub-group; must be > 0)", kind=(int, float))
    horovod: bool = _key(False, "TensorFlow/Horovod data parallelism",
                         not_built="modelparallel uses torch.distributed, not Horovod")
    prescaled_batch: bool = _key(
        False, "ranks of one tensor-parallel group read the same batch (sample by rdp_rank); "
        "False: each reads its own and the group concatenates them")
    shard_optimizer_state: bool = _key(
        False, "mp.DistributedOptimizer keeps each parameter's optimizer state on one "
               "data-parallel replica (ZeRO-1; replicas, i.e. ddp=True or "
               "hybrid_shard_degree=1: FSDP shards the state already)")
    # -- precision -------------------------------------------------------------------
    bf16: bool = _key(False, "bfloat16 mixed precision")
    fp16: bool = _key(False, "float16 mixed precision")
    fp16_params: bool = _key(False, "SMP v1.6-1.9 name of fp16")
    # -- memory ----------------------------------------------------------------------
    offload_activations: bool = _key(
        False, "SMP v1: DistributedModel offloads the inputs of checkpointed modules to CPU "
               "and prefetches them for backward")
    sm_activation_offloading: bool = _key(
        True, "SMP v2: torch's offload_wrapper prefetches within activation_loading_horizon "
              "(False: torch's own save_on_cpu)")
    activation_loading_horizon: int | None = _key(
        None, "most checkpointed layers whose offloaded inputs are back on the device awaiting "
              "backward (default: 4 for offload_activations, 2 for offload_wrapper)", minimum=1)
    delayed_parameter_initialization: bool = _key(
        False, "smp.model_creation() delays parameter initialization: parameters are "
               "allocated and initialised by the DistributedModel, only where they are held")
    # -- tensor parallel -------------------------------------------------------------
    random_seed: int = _key(12345, "seed of the random state of distributed modules",
                            minimum=0)
    tensor_parallel_seed: int = _key(
        0, "seed of the random ops in the regions of tensor-parallel plans marked "
           "replicated (SMP v1): the same on every tensor-parallel rank, so their masks agree",
        minimum=0)
    allow_empty_shards: bool = _key(
        False, "allow tensor-parallel shards with no elements",
        no_effect="FSDP2 holds each sharded parameter as a DTensor, which torch splits "
                  "unevenly, empty shards included, by itself")
    fsdp_cache_flush_warnings: bool = _key(
        True, "warn when the CUDA caching allocator flushes",
        no_effect="SMP v2's allocator-flush detector is not reimplemented; "
                  "torch.cuda.memory_stats()['num_alloc_retries'] counts the flushes")
    predefined_hooks: bool = _key(
        True, "built-in hooks for Hugging Face models",
        no_effect="tensor parallelism keeps the model's own parameter names and full "
                  "shapes, so state dicts need no translation hooks")
    # -- SMP v1 sharded data parallelism (FSDP2 decides the tuning keys per block) ----
    sdp_reduce_bucket_size: int = _key(
        500_000_000, "gradient bucket size", minimum=1,
        no_effect="FSDP reduce-scatters each wrapped block's gradients as one bucket")
    sdp_param_persistence_threshold: int = _key(
        1_000_000, "parameters below this many elements stay unsharded", minimum=0,
        no_effect="FSDP shards every parameter of a wrapped block, whatever its size")
    sdp_max_live_parameters: int = _key(
        1_000_000_000, "most parameters gathered at once", minimum=1,
        no_effect="FSDP gathers one wrapped block at a time, prefetching only the next one")
    sdp_hierarchical_allgather: bool = _key(
        True, "all-gather within nodes first",
        no_effect="NCCL chooses the all-gather algorithm and topology itself")
    sdp_gradient_clipping: float = _key(
        1.0, "gradient norm clipping threshold applied by DistributedOptimizer.step when "
             "sharded_data_parallel_degree > 1 (0 disables)", minimum=0.0, kind=(int, float))

    # ---------------------------------------------------------------------------------
    @classmethod
    def load(cls, source: Config | Mapping[str, Any] | str | os.PathLike | None = None,
             *, environ: Mapping[str, str] | None = None) -> Config:
        """Build a checked Config from a dict, a JSON/YAML file path, a Config or ``None``.

        The launcher's ``MP_CONFIG`` (JSON, read from ``environ``, default
        ``os.environ``) overrides the script's values; the overridden keys are
        logged once by rank 0.
        """
        environ = os.environ if environ is None else environ
        data = source.to_dict() if isinstance(source, Config) else read_source(source)
        unknown: list[tuple[str, str]] = []  # listed beside the values' problems
        script = normalise(data, origin="configuration", problems=unknown)
        launcher = normalise(read_launcher_config(environ), origin="MP_CONFIG",
                             problems=unknown)
        defaults = {f.name: f.default for f in dataclasses.fields(cls)}
        changed = {k: (script.get(k, defaults[k]), v) for k, v in launcher.items()
                   if script.get(k, defaults[k]) != v}
        rank0 = environ.get("RANK", "0") == "0"
        if changed and rank0:
            logger.warning("%s from the launcher overrides the script's configuration: %s",
                           " and ".join(n for n in ("MP_CONFIG", "SM_HP_MP_PARAMETERS")
                                        if environ.get(n)),
                           ", ".join(f"{k}: {a!r} -> {b!r}" for k, (a, b) in changed.items()))
        merged = {**script, **launcher}
        config = cls(**merged)
        try:
            config._check_values(warn=rank0 and not unknown)
        except ConfigError as e:
            raise ConfigError(unknown + e.problems) from None
        if unknown:
            raise ConfigError(unknown)
        given = source.explicit if isinstance(source, Config) else script.keys()
        object.__setattr__(config, "_explicit", frozenset(given) | frozenset(launcher))
        return config

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @property
    def explicit(self) -> frozenset[str]:
        """The keys the user set (script and ``MP_CONFIG`` merged; aliases resolved to
        their canonical names), even where the value equals the default: tells
        ``hybrid_shard_degree`` left alone from ``hybrid_shard_degree: 0``.

        Set by :meth:`load` (a Config passed to ``load`` keeps its own). A Config built
        directly (``Config(...)``, ``dataclasses.replace``) cannot tell, and reports the
        keys whose value differs from the default.
        """
        given = self.__dict__.get("_explicit")
        if given is None:
            given = frozenset(f.name for f in dataclasses.fields(self)
                              if getattr(self, f.name) != f.default)
        return given

    # -- derived values ---------------------------------------------------------------
    @property
    def placement_order(self) -> str:
        """The placement strategy as a permutation of D, P, T (outermost first)."""
        return PLACEMENT_NAMES.get(self.placement_strategy, self.placement_strategy.upper())

    @property
    def effective_memory_weight(self) -> float:
        if self.memory_weight is not None:
            return float(self.memory_weight)
        return 0.2 if self.optimize == "speed" else 0.8

    @property
    def stages_per_rank(self) -> int:
        """Pipeline stages each rank holds: ``virtual_stages``, or the schedule's default."""
        if self.virtual_stages is not None:
            return self.virtual_stages
        return schedule_rules.default_stages_per_rank(self.pipeline)

    @property
    def half_precision(self) -> str | None:
        """"bf16", "fp16" or None."""
        if self.bf16:
            return "bf16"
        return "fp16" if (self.fp16 or self.fp16_params) else None

    def model_parallel_product(self) -> int:
        """Ranks that hold different parts of one model: pp x tp. (The ranks of a
        context-parallel group hold the same parameters, sharded among the data-parallel
        ranks; they differ in the part of each sequence they compute. The ranks of an
        expert-parallel group are data-parallel ranks too: each reads its own samples and
        holds its share of the experts.)"""
        return self.tensor_parallel_degree * self.pipeline_parallel_degree

    @property
    def shard_degree(self) -> int:
        """The degree data parallelism shards over as asked: ``hybrid_shard_degree``, or
        ``sharded_data_parallel_degree`` when that is > 1 (0: every data-parallel rank)."""
        sdp = self.sharded_data_parallel_degree
        return self.hybrid_shard_degree or (sdp if sdp > 1 else 0)

    def with_changes(self, **changes: Any) -> Config:
        """This configuration with ``changes`` (checked as :meth:`load` checks), the
        changed keys counted as set by the user (``tsm.state`` degree setters)."""
        updated = dataclasses.replace(self, **changes)
        updated._check_values(warn=False)
        object.__setattr__(updated, "_explicit", self.explicit | frozenset(changes))
        return updated

    def _check_values(self, warn: bool = True) -> None:
        problems: list[tuple[str, str]] = []
        for f in dataclasses.fields(self):
            msg = config_keys.check_value(f, getattr(self, f.name))
            if msg:
                problems.append((f.name, msg))
        # combinations only make sense on well-typed values: check them with the
        # defaults in place of the bad values, and keep those that name no bad key
        bad = {name for name, _ in problems}
        checked = copy.copy(self)
        for name in bad:
            object.__setattr__(checked, name, Config.__dataclass_fields__[name].default)
        problems.extend((name, msg) for name, msg in checked._check_combinations()
                        if name not in bad and not any(b in msg for b in bad))
        if problems:
            raise ConfigError(problems)
        for f in dataclasses.fields(self):
            if warn and f.metadata["no_effect"] and getattr(self, f.name) != f.default:
                notice("%s=%r has no effect in modelparallel: %s",
                       f.name, getattr(self, f.name), f.metadata["no_effect"])

    def _check_combinations(self) -> list[tuple[str, str]]:
        problems = []
        order = self.placement_order
        if sorted(order) != ["D", "P", "T"]:
            perms = ", ".join(repr("".join(p)) for p in itertools.permutations("DPT"))
            problems.append(("placement_strategy",
                             f"{self.placement_strategy!r} is not valid; use 'cluster', "
                             f"'spread' or a permutation of the letters D, P, T: {perms}"))
        if self.bf16 and (self.fp16 or self.fp16_params):
            other = "fp16" if self.fp16 else "fp16_params"
            problems.append(("bf16", f"bf16=True cannot be combined with {other}=True; "
                                     "choose one half-precision type"))
        # 0 would fail every collective at once; inf and nan do not fit a timedelta
        if not 0 < self.collective_timeout < float("inf"):
            problems.append(("collective_timeout", f"{self.collective_timeout!r} is out of "
                                                   "range; must be > 0 and finite (seconds)"))
        stages = self.pipeline_parallel_degree * self.stages_per_rank
        if self.default_partition >= stages:
            problems.append(("default_partition",
                             f"{self.default_partition} is not a pipeline stage; valid stages "
                             f"are 0..{stages - 1} (pipeline_parallel_degree="
                             f"{self.pipeline_parallel_degree} x {self.stages_per_rank} "
                             "stages per rank)"))
        problems.extend(schedule_rules.check_schedule(
            self.pipeline, self.stages_per_rank, self.microbatches,
            self.pipeline_parallel_degree, self.active_microbatches))
        cp = self.context_parallel_degree
        if cp > 1 and self.pipeline_parallel_degree > 1:
            problems.append(("context_parallel_degree",
                             f"{cp} cannot be combined with pipeline_parallel_degree="
                             f"{self.pipeline_parallel_degree}: context parallelism works on "
                             "models given to tsm.transform (SMP v2, which has no pipeline); "
                             "set one of them to 1"))
        problems.extend(self._expert_parallel_problems())
        sdp = self.sharded_data_parallel_degree
        if sdp > 1 and self.shard_optimizer_state:
            problems.append(("shard_optimizer_state",
                             f"True cannot be combined with sharded_data_parallel_degree={sdp}, "
                             "which shards the optimizer state already (SMP v1 refuses it "
                             "too); set shard_optimizer_state to False"))
        if sdp > 1 and self.hybrid_shard_degree not in (0, sdp):
            problems.append(("sharded_data_parallel_degree",
                             f"{sdp} conflicts with hybrid_shard_degree="
                             f"{self.hybrid_shard_degree}; set only one of them"))
        for key, why in _NOT_BUILT.items():
            value = getattr(self, key)
            default = Config.__dataclass_fields__[key].default
            if value != default:
                problems.append((key, f"{value!r} is not supported yet ({why}); "
                                      f"valid value: {default!r}"))
        return problems

    def _expert_parallel_problems(self) -> list[tuple[str, str]]:
        """What expert parallelism cannot be combined with (yet): one line each."""
        ep = self.expert_parallel_degree
        if ep == 1:
            return []
        problems = []
        if self.pipeline_parallel_degree > 1:
            problems.append(("expert_parallel_degree",
                             f"{ep} cannot be combined with pipeline_parallel_degree="
                             f"{self.pipeline_parallel_degree}: expert parallelism works on "
                             "models given to tsm.transform (SMP v2, which has no pipeline); "
                             "set one of them to 1"))
        if self.context_parallel_degree > 1:
            problems.append(("expert_parallel_degree",
                             f"{ep} combined with context_parallel_degree="
                             f"{self.context_parallel_degree} is not built yet (experts split "
                             f"over ranks together with context parallelism); set one of "
                             f"them to 1"))
        return problems


DEGREE_KEYS = ("pipeline_parallel_degree", "tensor_parallel_degree",
               "context_parallel_degree", "expert_parallel_degree")

# Keys whose non-default values name features this library does not provide yet
# (declared with ``not_built=`` on the key).
_NOT_BUILT = {f.name: f.metadata["not_built"] for f in dataclasses.fields(Config)
              if f.metadata["not_built"]}


def normalise(data: dict[str, Any], origin: str,
              problems: list[tuple[str, str]] | None = None) -> dict[str, Any]:
    """Resolve aliases, reject unknown keys with suggestions, coerce integral floats
    (with ``problems``: unknown keys are added to it instead of raised)."""
    return config_keys.normalise(data, origin, Config.__dataclass_fields__, ALIASES, problems)
