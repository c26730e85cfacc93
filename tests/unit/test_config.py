"""Config: SMP defaults, loading, the launcher's MP_CONFIG override and every validation error."""

from __future__ import annotations

import dataclasses
import json
import logging

import pytest
import torch

from modelparallel.config import Config, ConfigError
from modelparallel.config_files import read_config_file
from modelparallel.precision_policy import PrecisionPolicy
from modelparallel.topology import (
    CommGroup,
    DataParallelLayout,
    Topology,
    Wrapper,
    check_world,
    data_parallel_size,
    shard_size,
)


def load(source=None, **environ) -> Config:
    """Config.load independent of the shell's environment."""
    return Config.load(source, environ=environ)


def error_of(source=None, **environ) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        load(source, **environ)
    return info.value


def message_for(err: ConfigError, key: str) -> str:
    """The message of the one problem reported for ``key``."""
    msgs = [msg for k, msg in err.problems if k == key]
    assert len(msgs) == 1, err.problems
    return msgs[0]


PARAMS = {"tensor_parallel_degree": 2, "microbatches": 4, "pipeline": "simple", "ddp": True}
YAML_TEXT = "tensor_parallel_degree: 2\nmicrobatches: 4\npipeline: simple\nddp: true\n"


def assert_params(config: Config) -> None:
    assert isinstance(config, Config)
    for key, value in PARAMS.items():
        assert getattr(config, key) == value, key
    assert config.pipeline_parallel_degree == 1  # untouched keys keep their defaults


SCRIPT = {"tensor_parallel_degree": 2, "microbatches": 4, "ddp": True}
LAUNCHER = {"tensor_parallel_degree": 4, "microbatches": 4, "pipeline": "simple"}


def override_records(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "modelparallel" and "MP_CONFIG" in
            r.getMessage()]


class TestDefaults:
    """Defaults are SMP's documented ones; derived values follow SMP's rules."""

    @pytest.mark.parametrize(("key", "default"), [
        ("tensor_parallel_degree", 1),
        ("pipeline_parallel_degree", 1),
        ("microbatches", 1),
        ("pipeline", "interleaved"),
        ("placement_strategy", "cluster"),
        ("auto_partition", True),
        ("default_partition", 0),
        ("optimize", "memory"),
        ("ddp", False),
        ("hybrid_shard_degree", 0),
        ("sharded_data_parallel_degree", 1),
        ("random_seed", 12345),
        ("activation_loading_horizon", None),  # SMP's: 4 for v1 offloading, 2 for v2
        ("offload_activations", False),
        ("sm_activation_offloading", True),  # SMP v2's default
        ("sdp_reduce_bucket_size", 500_000_000),
        ("memory_weight", None),
        ("active_microbatches", None),
        ("bf16", False),
        ("fp16", False),
        ("collective_timeout", 600),
        ("tensor_parallel_seed", 0),
        ("static_mode", False),
        ("fast_mode", False),
        ("overlapping_allreduce", True),
        ("sdp_gradient_clipping", 1.0),
    ])
    def test_default(self, key, default):
        value = getattr(load(), key)
        assert value == default
        assert type(value) is type(default)

    @pytest.mark.parametrize(("given", "weight"), [
        ({}, 0.8),
        ({"optimize": "memory"}, 0.8),
        ({"optimize": "speed"}, 0.2),
        ({"optimize": "speed", "memory_weight": 0.5}, 0.5),
        ({"memory_weight": 1}, 1.0),
        ({"memory_weight": 0.0}, 0.0),
    ])
    def test_effective_memory_weight(self, given, weight):
        assert load(given).effective_memory_weight == weight

    @pytest.mark.parametrize(("given", "stages"), [
        ({}, 1),
        ({"pipeline": "simple"}, 1),
        ({"pipeline": "interleaved_1f1b"}, 2),
        ({"pipeline": "looped_bfs", "virtual_stages": 3}, 3),
        ({"pipeline": "zbv_zero_bubble"}, 2),
    ])
    def test_stages_per_rank(self, given, stages):
        assert load(given).stages_per_rank == stages

    @pytest.mark.parametrize(("given", "order"), [
        ({}, "DPT"), ({"placement_strategy": "cluster"}, "DPT"),
        ({"placement_strategy": "spread"}, "TPD"), ({"placement_strategy": "ptd"}, "PTD"),
    ])
    def test_placement_order(self, given, order):
        assert load(given).placement_order == order


class TestPartitionsAlias:
    """`partitions` (SMP v1) is pipeline_parallel_degree; both at once must agree."""

    def test_partitions_alias(self):
        config = load({"partitions": 4})
        assert config.pipeline_parallel_degree == 4
        assert not hasattr(config, "partitions")

    def test_partitions_alias_same_value_accepted(self):
        assert load({"partitions": 2, "pipeline_parallel_degree": 2}).pipeline_parallel_degree == 2

    @pytest.mark.parametrize(("given", "key", "expected"), [
        ({"pipeline_parallel_degree": 2, "partitions": 4}, "partitions",
         "4 conflicts with pipeline_parallel_degree=2"),
        ({"partitions": 4, "pipeline_parallel_degree": 2}, "pipeline_parallel_degree",
         "2 conflicts with partitions=4"),
    ])
    def test_partitions_alias_conflict_names_both(self, given, key, expected):
        err = error_of(given)
        assert err.keys == [key]
        assert message_for(err, key) == (
            f"{expected} (partitions is an alias of pipeline_parallel_degree); set only one")


class TestLoading:
    """Dicts, JSON and YAML files (by extension or content), None, a Config, SageMaker's wrapper."""

    def test_load_dict(self):
        assert_params(load(PARAMS))

    def test_load_none_gives_defaults(self):
        assert load(None) == Config()
        assert load({}) == Config()

    def test_load_config_copies_its_values(self):
        original = load(PARAMS)
        again = load(original)
        assert again == original
        assert again is not original

    @pytest.mark.parametrize(("name", "text"), [
        ("mp.json", json.dumps(PARAMS)),
        ("mp.yaml", YAML_TEXT),
        ("mp.yml", YAML_TEXT),
        ("mp_config", YAML_TEXT),  # no extension: JSON first, then YAML
        ("mp_config_json", json.dumps(PARAMS)),
    ])
    def test_load_file(self, tmp_path, name, text):
        path = tmp_path / name
        path.write_text(text)
        assert_params(load(path))
        assert_params(load(str(path)))

    def test_load_empty_file_gives_defaults(self, tmp_path):
        path = tmp_path / "empty.yaml"
        path.write_text("")
        assert load(path) == Config()

    def test_sagemaker_wrapper_is_unwrapped(self, tmp_path):
        wrapped = {"enabled": True, "parameters": PARAMS}
        assert_params(load(wrapped))
        path = tmp_path / "sm.json"
        path.write_text(json.dumps(wrapped))
        assert_params(load(path))
        assert read_config_file(path) == PARAMS

    def test_integral_floats_accepted_for_int_keys(self):
        config = load({"sdp_reduce_bucket_size": 5e8, "microbatches": 4.0})
        assert config.sdp_reduce_bucket_size == 500_000_000
        assert type(config.sdp_reduce_bucket_size) is int
        assert config.microbatches == 4
        assert type(config.microbatches) is int

    def test_integral_float_json_file(self, tmp_path):
        path = tmp_path / "mp.json"
        path.write_text('{"tensor_parallel_degree": 2.0, "sdp_reduce_bucket_size": 5e8}')
        config = load(path)
        assert config.tensor_parallel_degree == 2
        assert type(config.tensor_parallel_degree) is int

    def test_unsupported_source_type(self):
        msg = str(error_of(42))
        assert "int" in msg and "dict" in msg and "YAML" in msg


class TestFileErrors:
    """A missing, unparsable or non-mapping file is a ConfigError naming the file."""

    def test_missing_file(self, tmp_path):
        path = tmp_path / "nope.yaml"
        err = error_of(path)
        assert err.keys == ["configuration"]
        assert str(path) in str(err) and "does not exist" in str(err)

    @pytest.mark.parametrize(("name", "text", "says"), [
        ("bad.json", '{"tensor_parallel_degree": 2,', "cannot parse"),
        ("bad.yaml", "tensor_parallel_degree: [2\n", "cannot parse"),
        ("bad", "{tensor_parallel_degree: [2\n", "cannot parse"),
        ("list.json", "[1, 2]", "holds a list; expected a mapping"),
        ("list.yaml", "- tensor_parallel_degree\n- 2\n", "holds a list; expected a mapping"),
    ])
    def test_unreadable_file(self, tmp_path, name, text, says):
        path = tmp_path / name
        path.write_text(text)
        err = error_of(path)
        assert err.keys == ["configuration"]
        assert says in str(err) and str(path) in str(err)


class TestMPConfig:
    """The launcher's MP_CONFIG overrides the script; rank 0 logs what changed, once."""

    def test_mp_config_overrides_script(self, caplog):
        caplog.set_level(logging.WARNING, logger="modelparallel")
        config = load(SCRIPT, MP_CONFIG=json.dumps(LAUNCHER), RANK="0")
        assert config.tensor_parallel_degree == 4
        assert config.pipeline == "simple"
        assert config.microbatches == 4
        assert config.ddp is True  # the script's keys the launcher leaves alone stay
        records = override_records(caplog)
        assert len(records) == 1
        assert records[0].levelno == logging.WARNING
        msg = records[0].getMessage()
        assert "tensor_parallel_degree: 2 -> 4" in msg
        assert "microbatches" not in msg  # same value: not an override

    def test_mp_config_alias_and_wrapper(self, caplog):
        caplog.set_level(logging.WARNING, logger="modelparallel")
        launcher = {"enabled": True, "parameters": {"partitions": 2}}
        config = load({"pipeline_parallel_degree": 4}, MP_CONFIG=json.dumps(launcher), RANK="0")
        assert config.pipeline_parallel_degree == 2
        assert "pipeline_parallel_degree: 4 -> 2" in override_records(caplog)[0].getMessage()

    def test_mp_config_replacing_a_default_is_logged(self, caplog):
        caplog.set_level(logging.WARNING, logger="modelparallel")
        load({}, MP_CONFIG=json.dumps({"microbatches": 8}), RANK="0")
        assert "microbatches: 1 -> 8" in override_records(caplog)[0].getMessage()

    def test_mp_config_not_logged_on_other_ranks(self, caplog):
        caplog.set_level(logging.DEBUG, logger="modelparallel")
        config = load(SCRIPT, MP_CONFIG=json.dumps(LAUNCHER), RANK="1")
        assert config.tensor_parallel_degree == 4
        assert caplog.records == []

    def test_mp_config_same_values_not_logged(self, caplog):
        caplog.set_level(logging.DEBUG, logger="modelparallel")
        load(SCRIPT, MP_CONFIG=json.dumps(SCRIPT), RANK="0")
        assert caplog.records == []

    def test_mp_config_empty_is_ignored(self):
        assert load(SCRIPT, MP_CONFIG="") == load(SCRIPT)

    def test_mp_config_invalid_json(self):
        err = error_of(SCRIPT, MP_CONFIG="{tensor_parallel_degree: 2")
        assert err.keys == ["MP_CONFIG"]
        assert "not valid JSON" in str(err)

    @pytest.mark.parametrize(("text", "kind"), [
        ("[1, 2]", "an array"), ("null", "null"), ('"tp=2"', "a string"), ("4", "a number"),
    ])
    def test_mp_config_not_an_object(self, text, kind):
        err = error_of(SCRIPT, MP_CONFIG=text)
        assert err.keys == ["MP_CONFIG"]
        assert kind in str(err) and "JSON object" in str(err)

    def test_mp_config_unknown_key(self):
        err = error_of(SCRIPT, MP_CONFIG=json.dumps({"tensor_paralel_degree": 2}))
        msg = message_for(err, "tensor_paralel_degree")
        assert "MP_CONFIG" in msg and "'tensor_parallel_degree'" in msg

    def test_mp_config_values_are_validated(self):
        err = error_of(SCRIPT, MP_CONFIG=json.dumps({"tensor_parallel_degree": 0}))
        assert err.keys == ["tensor_parallel_degree"]


class TestUnknownKeys:
    """An unknown key is named with the closest valid keys, or a pointer to --list."""

    @pytest.mark.parametrize(("typo", "suggestion"), [
        ("tensor_paralel_degree", "tensor_parallel_degree"),
        ("microbatch", "microbatches"),
        ("partition", "partitions"),
        ("placement_stratgy", "placement_strategy"),
    ])
    def test_unknown_key_suggests_closest(self, typo, suggestion):
        msg = message_for(error_of({typo: 2}), typo)
        assert "unknown key" in msg
        assert f"did you mean {suggestion!r}" in msg  # the closest match comes first

    def test_unknown_key_without_close_match(self):
        msg = message_for(error_of({"zzzz": 1}), "zzzz")
        assert "unknown key" in msg and "check-config --list" in msg


class TestValueChecks:
    """Type, range and choice errors name the key, the bad value and what is valid."""

    @pytest.mark.parametrize(("key", "value", "expected"), [
        ("tensor_parallel_degree", "2", "'2' has type str; expected int"),
        ("microbatches", True, "True has type bool; expected int"),
        ("pipeline_parallel_degree", 2.5, "2.5 has type float; expected int"),
        ("ddp", 1, "1 has type int; expected bool"),
        ("auto_partition", "yes", "'yes' has type str; expected bool"),
        ("memory_weight", True, "True has type bool; expected int or float"),
        ("memory_weight", "0.5", "'0.5' has type str; expected int or float"),
        ("collective_timeout", "60", "'60' has type str; expected int or float"),
        ("collective_timeout", True, "True has type bool; expected int or float"),
        ("pipeline", 1, "1 has type int; expected str"),
        ("tensor_parallel_degree", None, "must not be null; default is 1"),
    ])
    def test_wrong_type(self, key, value, expected):
        msg = message_for(error_of({key: value}), key)
        assert msg == expected

    @pytest.mark.parametrize(("key", "value", "expected"), [
        ("tensor_parallel_degree", 0, "0 is out of range; must be >= 1"),
        ("microbatches", -3, "-3 is out of range; must be >= 1"),
        ("memory_weight", 1.5, "1.5 is out of range; must be <= 1.0 and >= 0.0"),
        ("memory_weight", -0.1, "-0.1 is out of range; must be >= 0.0 and <= 1.0"),
        ("hybrid_shard_degree", -1, "-1 is out of range; must be >= 0"),
        ("ddp_port", 70000, "70000 is out of range; must be <= 65535 and >= 1"),
        ("ddp_port", 0, "0 is out of range; must be >= 1 and <= 65535"),
        ("sharded_data_parallel_degree", 0, "0 is out of range; must be >= 1"),
    ])
    def test_out_of_range(self, key, value, expected):
        msg = message_for(error_of({key: value}), key)
        assert msg == expected

    @pytest.mark.parametrize(("key", "value"), [
        ("memory_weight", 0), ("memory_weight", 1.0), ("ddp_port", 65535), ("ddp_port", 1),
        ("hybrid_shard_degree", 0), ("random_seed", 0),
    ])
    def test_range_bounds_accepted(self, key, value):
        assert getattr(load({key: value}), key) == value

    @pytest.mark.parametrize(("key", "value", "valid"), [
        ("pipeline", "foo", "'simple', 'interleaved', 'gpipe', '1f1b', 'interleaved_1f1b', "
         "'looped_bfs', 'interleaved_zero_bubble', 'zbv_zero_bubble', 'dualpipe_v'"),
        ("optimize", "fast", "'memory', 'speed'"),
        ("ddp_dist_backend", "mpi", "'auto', 'nccl', 'gloo'"),
    ])
    def test_bad_choice(self, key, value, valid):
        msg = message_for(error_of({key: value}), key)
        assert msg == f"{value!r} is not one of {valid}"

    @pytest.mark.parametrize("value", ["DDT", "xyz", "DP", "DPTT", ""])
    def test_bad_placement_strategy_lists_permutations(self, value):
        msg = message_for(error_of({"placement_strategy": value}), "placement_strategy")
        assert f"{value!r} is not valid" in msg
        assert "'cluster'" in msg and "'spread'" in msg
        for perm in ("DPT", "DTP", "PDT", "PTD", "TDP", "TPD"):
            assert f"'{perm}'" in msg

    @pytest.mark.parametrize("value", ["DPT", "DTP", "PDT", "PTD", "TDP", "TPD", "tpd", "spread"])
    def test_valid_placement_strategies(self, value):
        assert load({"placement_strategy": value}).placement_strategy == value


class TestCombinations:
    """Keys that cannot be combined, and features that are not built yet."""

    @pytest.mark.parametrize("other", ["fp16", "fp16_params"])
    def test_half_precision_conflict(self, other):
        msg = message_for(error_of({"bf16": True, other: True}), "bf16")
        assert f"bf16=True cannot be combined with {other}=True" in msg

    @pytest.mark.parametrize(("given", "precision"), [
        ({}, None), ({"bf16": True}, "bf16"), ({"fp16": True}, "fp16"),
        ({"fp16_params": True}, "fp16"),
    ])
    def test_half_precision(self, given, precision):
        assert load(given).half_precision == precision

    @pytest.mark.parametrize(("pp", "partition"), [(1, 1), (2, 2), (2, 5)])
    def test_default_partition_must_be_a_stage(self, pp, partition):
        err = error_of({"pipeline_parallel_degree": pp, "default_partition": partition})
        msg = message_for(err, "default_partition")
        assert f"{partition} is not a pipeline stage" in msg
        assert f"0..{pp - 1}" in msg and f"pipeline_parallel_degree={pp}" in msg

    def test_default_partition_last_stage_accepted(self):
        assert load({"pipeline_parallel_degree": 3, "default_partition": 2}).default_partition == 2

    @pytest.mark.parametrize("hybrid", [1, 4])
    def test_sharded_data_parallel_conflicts_with_hybrid(self, hybrid):
        err = error_of({"sharded_data_parallel_degree": 2, "hybrid_shard_degree": hybrid})
        msg = message_for(err, "sharded_data_parallel_degree")
        assert msg == f"2 conflicts with hybrid_shard_degree={hybrid}; set only one of them"

    @pytest.mark.parametrize("hybrid", [0, 2])
    def test_sharded_data_parallel_agreeing_with_hybrid(self, hybrid):
        config = load({"sharded_data_parallel_degree": 2, "hybrid_shard_degree": hybrid})
        assert shard_size(config, 8) == 2

    @pytest.mark.parametrize("value", [0, 0.0, -5, float("inf"), float("nan")])
    def test_collective_timeout_must_be_positive_and_finite(self, value):
        msg = message_for(error_of({"collective_timeout": value}), "collective_timeout")
        assert msg == f"{value!r} is out of range; must be > 0 and finite (seconds)"

    @pytest.mark.parametrize("value", [0.5, 5, 7200])
    def test_collective_timeout_accepts_seconds(self, value):
        assert load({"collective_timeout": value}).collective_timeout == value
        assert load(MP_CONFIG=json.dumps({"collective_timeout": value})).collective_timeout \
            == value

    def test_several_type_problems_reported_together(self):
        err = error_of({"tensor_parallel_degree": 0, "pipeline": "foo", "ddp": 1,
                        "memory_weight": 2.0})
        assert sorted(err.keys) == ["ddp", "memory_weight", "pipeline", "tensor_parallel_degree"]
        for key in err.keys:
            assert f"  - {key}: " in str(err)

    def test_several_combination_problems_reported_together(self):
        err = error_of({"bf16": True, "fp16": True, "placement_strategy": "DDT", "horovod": True,
                        "default_partition": 1, "sharded_data_parallel_degree": 2,
                        "hybrid_shard_degree": 4})
        assert sorted(err.keys) == ["bf16", "default_partition", "horovod", "placement_strategy",
                                    "sharded_data_parallel_degree"]

    def test_several_unknown_keys_reported_together(self):
        err = error_of({"tensor_paralel_degree": 2, "microbatch": 2, "tensor_parallel_degree": 2})
        assert err.keys == ["tensor_paralel_degree", "microbatch"]


# Every key with an effect: it does what SMP documents. A key added to Config must be
# put here, given a no-effect reason, or refused when not at its default (not_built).
EFFECT_KEYS = {
    "tensor_parallel_degree", "context_parallel_degree", "pipeline_parallel_degree",
    "expert_parallel_degree", "hybrid_shard_degree",
    "sharded_data_parallel_degree", "placement_strategy", "microbatches", "pipeline",
    "virtual_stages", "active_microbatches", "auto_partition", "default_partition",
    "memory_weight", "optimize", "ddp", "ddp_dist_backend", "collective_timeout",
    "prescaled_batch", "bf16", "fp16", "fp16_params", "random_seed", "tensor_parallel_seed",
    "sdp_gradient_clipping", "offload_activations", "sm_activation_offloading",
    "activation_loading_horizon", "shard_optimizer_state", "delayed_parameter_initialization",
}

# key: (a non-default value, the reason logged)
NO_EFFECT = {
    "contiguous": (False, "pipeline stages are always contiguous ranges of layers here"),
    "deterministic_server": (True, "every rank runs the same static pipeline schedule, so "
                                   "requests are always processed in the same order"),
    "skip_tracing": (True, "the automatic split needs one traced microbatch, which is cheap, "
                           "so it always traces"),
    "static_mode": (True, "there is no request/response exchange to skip: every rank runs a "
                          "fixed torch.distributed.pipelining schedule each step"),
    "fast_mode": (True, "stages always send activations directly to the next stage "
                        "(torch.distributed.pipelining point-to-point); there is no parent "
                        "relay"),
    "ddp_port": (29500, "the default process group uses the launcher's rendezvous "
                        "(MASTER_ADDR/MASTER_PORT); data-parallel groups are sub-groups of it"),
    "overlapping_allreduce": (False, "FSDP and DDP always overlap gradient reduction with the "
                                     "backward pass here"),
    "allow_empty_shards": (True, "FSDP2 holds each sharded parameter as a DTensor, which torch "
                                 "splits unevenly, empty shards included, by itself"),
    "fsdp_cache_flush_warnings": (False, "SMP v2's allocator-flush detector is not "
                                         "reimplemented; torch.cuda.memory_stats()"
                                         "['num_alloc_retries'] counts the flushes"),
    "predefined_hooks": (False, "tensor parallelism keeps the model's own parameter names and "
                                "full shapes, so state dicts need no translation hooks"),
    "sdp_reduce_bucket_size": (100_000_000, "FSDP reduce-scatters each wrapped block's "
                                            "gradients as one bucket"),
    "sdp_param_persistence_threshold": (0, "FSDP shards every parameter of a wrapped block, "
                                           "whatever its size"),
    "sdp_max_live_parameters": (10, "FSDP gathers one wrapped block at a time, prefetching "
                                    "only the next one"),
    "sdp_hierarchical_allgather": (False, "NCCL chooses the all-gather algorithm and topology "
                                          "itself"),
}

# key: (a non-default value, the whole ConfigError message for the key)
REFUSED = {
    "horovod": (True, "True is not supported yet (modelparallel uses torch.distributed, not "
                      "Horovod); valid value: False"),
}


def warnings_of(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == "modelparallel" and r.levelno >= logging.WARNING]


class TestEveryKeyDecided:
    """Every key has an effect, is marked no-effect with a reason, or is refused when set."""

    @pytest.mark.parametrize("f", dataclasses.fields(Config), ids=lambda f: f.name)
    def test_key_is_effect_no_effect_or_refused(self, f):
        reason, not_built = f.metadata["no_effect"], f.metadata["not_built"]
        kinds = [f.name in EFFECT_KEYS, reason is not None, not_built is not None]
        assert sum(kinds) == 1, (f"{f.name}: decide whether it has an effect (EFFECT_KEYS), "
                                 f"no effect (no_effect=reason) or is refused (not_built=)")
        if reason is not None:
            assert isinstance(reason, str) and reason.strip() and "\n" not in reason
            assert f.name in NO_EFFECT, f"{f.name}: add its value and message to NO_EFFECT"
        if not_built is not None:
            assert f.name in REFUSED, f"{f.name}: add its value and message to REFUSED"
            value = (not f.default) if isinstance(f.default, bool) else f.default + 1
            msg = message_for(error_of({f.name: value}), f.name)
            assert msg == f"{value!r} is not supported yet ({not_built}); " \
                          f"valid value: {f.default!r}"

    def test_tables_name_only_real_keys(self):
        fields = set(Config.__dataclass_fields__)
        assert set(EFFECT_KEYS) <= fields
        assert set(NO_EFFECT) <= fields
        assert set(REFUSED) <= fields
        assert not (set(EFFECT_KEYS) & set(NO_EFFECT)) and not (set(EFFECT_KEYS) & set(REFUSED))

    @pytest.mark.parametrize("key", sorted(EFFECT_KEYS))
    def test_effect_keys_have_no_reason(self, key):
        meta = Config.__dataclass_fields__[key].metadata
        assert meta["no_effect"] is None and meta["not_built"] is None


class TestNoEffectKeys:
    """Keys kept for compatibility log one line, on rank 0, when set to anything but their
    default: the key, the value and why it has no effect here."""

    @pytest.mark.parametrize(("key", "value", "reason"),
                             [(k, v, r) for k, (v, r) in NO_EFFECT.items()])
    def test_no_effect_key_logs_its_reason(self, caplog, key, value, reason):
        caplog.set_level(logging.DEBUG, logger="modelparallel")
        assert getattr(load({key: value}, RANK="0"), key) == value
        assert Config.__dataclass_fields__[key].default != value
        assert len(caplog.records) == 1
        record = caplog.records[0]
        assert record.levelno == logging.WARNING
        assert record.getMessage() == f"{key}={value!r} has no effect in modelparallel: {reason}"
        assert "\n" not in record.getMessage()

    @pytest.mark.parametrize(("key", "value"), [(k, v) for k, (v, _) in NO_EFFECT.items()])
    def test_no_effect_key_silent_on_other_ranks(self, caplog, key, value):
        caplog.set_level(logging.DEBUG, logger="modelparallel")
        assert getattr(Config.load({key: value}, environ={"RANK": "1"}), key) == value
        assert caplog.records == []

    def test_several_no_effect_keys_one_line_each(self, caplog):
        caplog.set_level(logging.DEBUG, logger="modelparallel")
        load({"ddp_port": 29500, "contiguous": False, "overlapping_allreduce": False})
        msgs = warnings_of(caplog)
        assert len(msgs) == 3
        for key in ("ddp_port", "contiguous", "overlapping_allreduce"):
            assert sum(m.startswith(f"{key}=") for m in msgs) == 1

    def test_no_effect_key_from_mp_config_logs_its_reason(self, caplog):
        caplog.set_level(logging.DEBUG, logger="modelparallel")
        load({}, MP_CONFIG=json.dumps({"static_mode": True}), RANK="0")
        msgs = [m for m in warnings_of(caplog) if "has no effect" in m]
        assert msgs == [f"static_mode=True has no effect in modelparallel: "
                        f"{NO_EFFECT['static_mode'][1]}"]

    @pytest.mark.parametrize("key", list(NO_EFFECT))
    def test_no_effect_key_at_default_is_silent(self, caplog, key):
        caplog.set_level(logging.DEBUG, logger="modelparallel")
        load({key: Config.__dataclass_fields__[key].default, "tensor_parallel_degree": 2})
        assert caplog.records == []

    @pytest.mark.parametrize(("key", "value"), [
        ("ddp_port", "29500"), ("static_mode", 1), ("fast_mode", "yes"),
        ("overlapping_allreduce", None), ("ddp_port", 0),
    ])
    def test_no_effect_keys_are_still_type_checked(self, key, value):
        assert error_of({key: value}).keys == [key]

    @pytest.mark.parametrize(("key", "value"), [
        ("sdp_gradient_clipping", 0.5), ("sdp_gradient_clipping", 0),
        ("tensor_parallel_seed", 7), ("optimize", "speed"),
    ])
    def test_keys_with_an_effect_do_not_claim_none(self, caplog, key, value):
        caplog.set_level(logging.DEBUG, logger="modelparallel")
        assert getattr(load({key: value}), key) == value
        assert caplog.records == []


class TestRefusedKeys:
    """Features not built yet: any value but the default is a ConfigError saying so."""

    @pytest.mark.parametrize(("key", "value", "expected"),
                             [(k, v, m) for k, (v, m) in REFUSED.items()])
    def test_refused_key_message(self, key, value, expected):
        err = error_of({key: value})
        assert err.keys == [key]
        assert message_for(err, key) == expected
        assert f"  - {key}: {expected}" in str(err)

    @pytest.mark.parametrize(("key", "value"), [(k, v) for k, (v, _) in REFUSED.items()])
    def test_refused_key_refused_on_every_rank(self, key, value):
        assert error_of({key: value}, RANK="3").keys == [key]

    @pytest.mark.parametrize("key", list(REFUSED))
    def test_refused_key_at_default_accepted(self, caplog, key):
        caplog.set_level(logging.DEBUG, logger="modelparallel")
        default = Config.__dataclass_fields__[key].default
        assert getattr(load({key: default}), key) == default
        assert caplog.records == []

    def test_refused_key_from_mp_config(self):
        err = error_of({}, MP_CONFIG=json.dumps({"horovod": True}))
        assert message_for(err, "horovod") == REFUSED["horovod"][1]


class TestActivationOffloading:
    """offload_activations, sm_activation_offloading and activation_loading_horizon act
    (tests/unit/test_activation_offloader.py); the horizon is a positive int."""

    @pytest.mark.parametrize("value", [1, 2, 3, 8])
    def test_horizon_accepted(self, value):
        config = load({"activation_loading_horizon": value, "offload_activations": True,
                       "sm_activation_offloading": False})
        assert (config.activation_loading_horizon, config.offload_activations,
                config.sm_activation_offloading) == (value, True, False)

    @pytest.mark.parametrize("value", [0, -1])
    def test_horizon_below_one_refused(self, value):
        msg = message_for(error_of({"activation_loading_horizon": value}),
                          "activation_loading_horizon")
        assert msg == f"{value!r} is out of range; must be >= 1"


class TestTensorParallelSeed:
    """SMP v1's tensor_parallel_seed: an int >= 0, default 0."""

    @pytest.mark.parametrize("value", [0, 1, 12345, 2**31])
    def test_accepted(self, value):
        config = load({"tensor_parallel_seed": value})
        assert config.tensor_parallel_seed == value
        assert type(config.tensor_parallel_seed) is int

    def test_integral_float_accepted(self):
        config = load({"tensor_parallel_seed": 7.0})
        assert config.tensor_parallel_seed == 7 and type(config.tensor_parallel_seed) is int

    @pytest.mark.parametrize(("value", "expected"), [
        (-1, "-1 is out of range; must be >= 0"),
        (1.5, "1.5 has type float; expected int"),
        ("3", "'3' has type str; expected int"),
        (True, "True has type bool; expected int"),
        (None, "must not be null; default is 0"),
    ])
    def test_invalid(self, value, expected):
        err = error_of({"tensor_parallel_seed": value})
        assert err.keys == ["tensor_parallel_seed"]
        assert message_for(err, "tensor_parallel_seed") == expected

    def test_from_mp_config(self):
        assert load(MP_CONFIG=json.dumps({"tensor_parallel_seed": 3})).tensor_parallel_seed == 3


class TestExplicitKeys:
    """Config.explicit: the keys the user set, even to the default value."""

    def test_nothing_set(self):
        assert load().explicit == frozenset()
        assert load({}).explicit == frozenset()

    def test_default_value_set_explicitly(self):
        given, left = load({"hybrid_shard_degree": 0}), load()
        assert given.hybrid_shard_degree == left.hybrid_shard_degree == 0
        assert given.explicit == frozenset({"hybrid_shard_degree"})
        assert "hybrid_shard_degree" not in left.explicit

    def test_is_a_frozenset(self):
        assert isinstance(load({"microbatches": 2}).explicit, frozenset)

    def test_alias_resolved(self):
        assert load({"partitions": 2}).explicit == frozenset({"pipeline_parallel_degree"})

    def test_script_and_mp_config_merged(self):
        config = load({"microbatches": 2, "ddp": True},
                      MP_CONFIG=json.dumps({"partitions": 2, "microbatches": 2}))
        assert config.explicit == frozenset({"microbatches", "ddp", "pipeline_parallel_degree"})

    def test_wrapper_and_file(self, tmp_path):
        path = tmp_path / "mp.yaml"
        path.write_text("hybrid_shard_degree: 0\npartitions: 1\n")
        expected = frozenset({"hybrid_shard_degree", "pipeline_parallel_degree"})
        assert load(path).explicit == expected
        wrapped = {"enabled": True, "parameters": {"hybrid_shard_degree": 0, "partitions": 1}}
        assert load(wrapped).explicit == expected

    def test_not_a_field_and_not_compared(self):
        given = load({"hybrid_shard_degree": 0})
        assert given == load()
        assert given.to_dict() == load().to_dict()
        assert "explicit" not in given.to_dict() and "_explicit" not in given.to_dict()
        assert "explicit" not in Config.__dataclass_fields__
        assert "explicit" not in repr(given)

    def test_read_only(self):
        config = load({"microbatches": 2})
        with pytest.raises(AttributeError):
            config.explicit = frozenset()  # type: ignore[misc]

    def test_loading_a_config_keeps_its_explicit_keys(self):
        first = load({"hybrid_shard_degree": 0})
        assert load(first).explicit == frozenset({"hybrid_shard_degree"})
        again = load(first, MP_CONFIG=json.dumps({"microbatches": 4}))
        assert again.explicit == frozenset({"hybrid_shard_degree", "microbatches"})

    def test_config_built_directly_reports_non_default_keys(self):
        assert Config(tensor_parallel_degree=2).explicit == frozenset({"tensor_parallel_degree"})
        assert Config().explicit == frozenset()
        assert dataclasses.replace(load({"hybrid_shard_degree": 0}), microbatches=2).explicit \
            == frozenset({"microbatches"})


class TestWorldSize:
    """check_world and shard_size (topology.py): degrees against the number of processes."""

    @pytest.mark.parametrize(("given", "world"), [
        ({}, 1),
        ({"tensor_parallel_degree": 2, "pipeline_parallel_degree": 2}, 8),
        ({"tensor_parallel_degree": 2, "pipeline_parallel_degree": 2}, 4),
        ({"tensor_parallel_degree": 2, "hybrid_shard_degree": 2}, 8),
        ({"tensor_parallel_degree": 2, "hybrid_shard_degree": 4}, 8),
        ({"tensor_parallel_degree": 2, "hybrid_shard_degree": 1}, 8),
        ({"sharded_data_parallel_degree": 4}, 8),
        ({"pipeline_parallel_degree": 3}, 12),
    ])
    def test_valid_world(self, given, world):
        check_world(load(given), world)  # raises on failure

    @pytest.mark.parametrize(("given", "world", "factors", "product", "key"), [
        ({"tensor_parallel_degree": 3}, 8, "tensor_parallel_degree=3", 3, "tensor_parallel_degree"),
        ({"pipeline_parallel_degree": 3}, 8, "pipeline_parallel_degree=3", 3,
         "pipeline_parallel_degree"),
        ({"tensor_parallel_degree": 2, "pipeline_parallel_degree": 4}, 4,
         "pipeline_parallel_degree=4 x tensor_parallel_degree=2", 8, "tensor_parallel_degree"),
    ])
    def test_degrees_not_dividing_world(self, given, world, factors, product, key):
        with pytest.raises(ConfigError) as info:
            check_world(load(given), world)
        msg = message_for(info.value, key)
        assert msg.startswith(f"{factors} = {product} does not divide the world size {world}")

    @pytest.mark.parametrize(("key", "degree", "valid"), [
        ("hybrid_shard_degree", 3, "0, 1, 2, 4"),
        ("hybrid_shard_degree", 8, "0, 1, 2, 4"),
        ("sharded_data_parallel_degree", 3, "1, 2, 4"),  # sdp has no 0; its minimum is 1
    ])
    def test_shard_degree_not_dividing_data_parallel_size(self, key, degree, valid):
        config = load({"tensor_parallel_degree": 2, key: degree})
        with pytest.raises(ConfigError) as info:
            check_world(config, 8)
        msg = message_for(info.value, key)
        assert msg.startswith(f"{degree} does not divide the data-parallel size 4")
        assert "world size 8" in msg
        assert msg.endswith(f"valid values: {valid}")
        for value in valid.split(", "):  # every listed value really is valid
            check_world(load({"tensor_parallel_degree": 2, key: int(value)}), 8)

    @pytest.mark.parametrize("world", [0, -2, 2.0, True])
    def test_world_size_must_be_positive_int(self, world):
        with pytest.raises(ConfigError) as info:
            check_world(load(), world)
        assert info.value.keys == ["world_size"]
        assert repr(world) in str(info.value)

    @pytest.mark.parametrize(("given", "world", "dp", "shard"), [
        ({}, 8, 8, 8),
        ({"hybrid_shard_degree": 0}, 8, 8, 8),
        ({"hybrid_shard_degree": 1}, 8, 8, 1),
        ({"hybrid_shard_degree": 4}, 8, 8, 4),
        ({"tensor_parallel_degree": 2}, 8, 4, 4),
        ({"tensor_parallel_degree": 2, "hybrid_shard_degree": 2}, 8, 4, 2),
        ({"sharded_data_parallel_degree": 2}, 8, 8, 2),
        ({"sharded_data_parallel_degree": 4, "pipeline_parallel_degree": 2}, 8, 4, 4),
    ])
    def test_shard_size(self, given, world, dp, shard):
        config = load(given)
        assert data_parallel_size(config, world) == dp
        assert shard_size(config, world) == shard


class TestContextParallelLayout:
    """SMP's rule: the context-parallel ranks shard the model together (cp divides the
    shard degree); they are consecutive ranks of dp_shard and read the same samples."""

    def test_cp_ranks_lie_inside_the_shard_group(self):
        config = load({"context_parallel_degree": 2, "hybrid_shard_degree": 2})
        topology = Topology.from_config(config, 4)
        assert (topology.dp_replicate, topology.dp_shard, topology.cp) == (2, 2, 2)
        assert topology.cp_groups() == [[0, 1], [2, 3]]
        assert [topology.cp_rank(r) for r in range(4)] == [0, 1, 0, 1]
        # the samples: one stream per cp group, as the v2 scripts' rank // (tp * cp)
        assert [topology.reading_rank(r, CommGroup.RDP_GROUP) for r in range(4)] == \
            [(0, 2), (0, 2), (1, 2), (1, 2)]

    def test_with_tensor_parallelism_tp_varies_fastest(self):
        config = load({"context_parallel_degree": 2, "tensor_parallel_degree": 2,
                       "hybrid_shard_degree": 2})
        topology = Topology.from_config(config, 8)
        assert topology.cp_groups() == [[0, 2], [1, 3], [4, 6], [5, 7]]
        assert [topology.reading_rank(r, CommGroup.RDP_GROUP)[0] for r in range(8)] == \
            [r // 4 for r in range(8)]

    def test_tensor_parallel_ranks_read_apart_whatever_the_placement(self):
        """The parity matrix found it: with ``spread`` (tp outermost) a tp group's ranks
        are not neighbours in the data-parallel group; they must still read different
        rows, and a cp group's ranks the same rows."""
        for placement in ("cluster", "spread"):
            topology = Topology.from_config(load({
                "context_parallel_degree": 2, "tensor_parallel_degree": 2,
                "placement_strategy": placement}), 4)
            reads = {r: topology.reading_rank(r, CommGroup.DP_GROUP) for r in range(4)}
            for group in topology.cp_groups():
                assert len({reads[r] for r in group}) == 1, placement
            for group in topology.all_groups(CommGroup.TP_GROUP):
                assert len({reads[r] for r in group}) == 2, placement

    @pytest.mark.parametrize("given, world, key, message", [
        ({"context_parallel_degree": 2, "hybrid_shard_degree": 1}, 4, "hybrid_shard_degree",
         "1 is not a multiple of context_parallel_degree=2: the ranks of a context-parallel "
         "group shard the model together (as in SMP v2, context_parallel_degree <= "
         "hybrid_shard_degree); valid values: 0, 2, 4"),
        ({"context_parallel_degree": 3}, 4, "context_parallel_degree",
         "3 does not divide the 4 data-parallel ranks the model is sharded over "
         "(hybrid_shard_degree=0); valid values: 1, 2, 4"),
    ])
    def test_a_degree_that_does_not_fit_is_refused(self, given, world, key, message):
        with pytest.raises(ConfigError) as err:
            Topology.from_config(load(given), world)
        assert message_for(err.value, key) == message

    def test_with_a_pipeline_refused(self):
        err = error_of({"context_parallel_degree": 2, "pipeline_parallel_degree": 2})
        assert "cannot be combined with pipeline_parallel_degree=2" in \
            message_for(err, "context_parallel_degree")


class TestExpertParallelLayout:
    """The experts are split over data-parallel ranks (consecutive ones, which read
    different samples); each expert's copies are sharded within a dp_shard group."""

    @pytest.mark.parametrize("hsd, world, groups, copies", [
        (0, 2, [[0, 1]], [[[0]], [[1]]]),
        (2, 4, [[0, 1], [2, 3]], [[[0], [2]], [[1], [3]]]),  # replicated: 2 shard groups
        (0, 4, [[0, 1], [2, 3]], [[[0, 2]], [[1, 3]]]),      # sharded over 2 ranks
        (4, 8, [[0, 1], [2, 3], [4, 5], [6, 7]], [[[0, 2], [4, 6]], [[1, 3], [5, 7]]]),
    ])
    def test_ep_groups_and_the_ranks_holding_the_same_experts(self, hsd, world, groups,
                                                              copies):
        topology = Topology.from_config(
            load({"expert_parallel_degree": 2, "hybrid_shard_degree": hsd}), world)
        assert topology.dp_replicate * topology.dp_shard == world  # ep is data-parallel
        assert topology.ep_groups() == groups
        assert topology.expert_data_parallel_groups() == copies
        assert [topology.ep_rank(r) for r in range(world)] == [r % 2 for r in range(world)]
        assert [topology.reading_rank(r, CommGroup.RDP_GROUP) for r in range(world)] == \
            [(r, world) for r in range(world)]

    @pytest.mark.parametrize("hsd, world, groups, copies", [
        (0, 4, [[0, 2], [1, 3]], [[[0]], [[2]], [[1]], [[3]]]),
        (2, 8, [[0, 2], [4, 6], [1, 3], [5, 7]],              # replicated over 2 ranks
         [[[0], [4]], [[2], [6]], [[1], [5]], [[3], [7]]]),
        (0, 8, [[0, 2], [4, 6], [1, 3], [5, 7]],              # sharded over 2 ranks
         [[[0, 4]], [[2, 6]], [[1, 5]], [[3, 7]]]),
    ])
    def test_with_tensor_parallelism_each_tp_rank_has_its_own_groups(self, hsd, world,
                                                                      groups, copies):
        # tp is the innermost dim: the ep groups and the ranks holding the same experts
        # are data-parallel ranks with the same tp rank (never two ranks of a tp group)
        topology = Topology.from_config(load({"expert_parallel_degree": 2,
                                              "tensor_parallel_degree": 2,
                                              "hybrid_shard_degree": hsd}), world)
        assert topology.ep_groups() == groups
        assert topology.expert_data_parallel_groups() == copies
        assert [topology.ep_rank(r) for r in range(world)] == [r // 2 % 2 for r in range(world)]

    def test_a_degree_that_does_not_divide_the_data_parallel_size_is_refused(self):
        with pytest.raises(ConfigError) as err:
            Topology.from_config(load({"expert_parallel_degree": 3}), 4)
        assert message_for(err.value, "expert_parallel_degree") == (
            "3 does not divide the data-parallel size 4 (world size 4 / 1 model-parallel "
            "ranks): the experts are split over data-parallel ranks; valid values: 1, 2, 4")

    @pytest.mark.parametrize("key, message", [
        ("pipeline_parallel_degree", "2 cannot be combined with pipeline_parallel_degree=2: "
         "expert parallelism works on models given to tsm.transform (SMP v2, which has no "
         "pipeline); set one of them to 1"),
        ("context_parallel_degree", "2 combined with context_parallel_degree=2 is not built "
         "yet (experts split over ranks together with context parallelism); set one of "
         "them to 1"),
    ])
    def test_combinations_not_built_are_refused(self, key, message):
        err = error_of({"expert_parallel_degree": 2, key: 2})
        assert message_for(err, "expert_parallel_degree") == message


@pytest.mark.parametrize("keys, explicit, sets_layout", [
    ({}, False, False),                                  # 0: every rank; FSDP1 as torch has it
    ({"hybrid_shard_degree": 1}, False, True),           # replicas, asked for
    ({"hybrid_shard_degree": 2}, True, True),
    ({"sharded_data_parallel_degree": 2}, True, True),
])
def test_the_questions_asked_of_the_sharding_keys(keys, explicit, sets_layout):
    two_shards = Topology(pp=1, dp_replicate=1, dp_shard=2, tp=1)
    layout = DataParallelLayout.decide(Config.load(keys, environ={}), two_shards)
    assert layout.explicit_sharding is explicit
    assert layout.sets_shard_layout is sets_layout
    assert layout.model_wrapper is Wrapper.FSDP2
    with_ddp = DataParallelLayout.decide(Config.load({**keys, "ddp": True}, environ={}),
                                         two_shards)
    assert with_ddp.model_wrapper is (Wrapper.FSDP2 if explicit else Wrapper.REPLICAS)


@pytest.mark.parametrize("keys, param, loss_scaling", [
    ({}, None, False),
    ({"bf16": True}, torch.bfloat16, False),
    ({"fp16": True}, torch.float16, True),
])
def test_the_precision_policy_is_decided_from_the_half_keys(keys, param, loss_scaling):
    policy = PrecisionPolicy.decide(Config.load(keys, environ={}))
    assert (policy.param_dtype, policy.loss_scaling, policy.mixed) == \
        (param, loss_scaling, param is not None)
    assert policy.reduce_dtype == (torch.float32 if param else None)
    assert policy.buffer_dtype is None  # buffers keep their dtype on every path
