"""Config: SMP defaults, loading, the launcher's MP_CONFIG override and every validation error."""

from __future__ import annotations

import json
import logging

import pytest

from modelparallel.config import Config, ConfigError, read_config_file


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
        ("activation_loading_horizon", 4),
        ("sdp_reduce_bucket_size", 500_000_000),
        ("memory_weight", None),
        ("active_microbatches", None),
        ("bf16", False),
        ("fp16", False),
        ("collective_timeout", 600),
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
        assert config.shard_size(8) == 2

    @pytest.mark.parametrize(("key", "value", "valid"), [
        ("context_parallel_degree", 2, 1),
        ("expert_parallel_degree", 2, 1),
        ("horovod", True, False),
        ("shard_optimizer_state", True, False),
        ("offload_activations", True, False),
        ("sm_activation_offloading", True, False),
        ("delayed_parameter_initialization", True, False),
    ])
    def test_not_built_features(self, key, value, valid):
        msg = message_for(error_of({key: value}), key)
        assert msg.startswith(f"{value!r} is not supported yet")
        assert msg.endswith(f"valid value: {valid!r}")

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


class TestNoEffectKeys:
    """Keys kept for compatibility warn when set to anything but their default."""

    @pytest.mark.parametrize(("key", "value"), [
        ("sdp_reduce_bucket_size", 100_000_000),
        ("allow_empty_shards", True),
        ("sdp_gradient_clipping", 0.5),
    ])
    def test_no_effect_key_warns(self, caplog, key, value):
        caplog.set_level(logging.WARNING, logger="modelparallel")
        assert getattr(load({key: value}), key) == value
        msgs = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert len(msgs) == 1
        assert msgs[0].startswith(f"{key}={value!r}") and "has no effect" in msgs[0]

    def test_no_effect_key_warns_on_rank_0_only(self, caplog):
        caplog.set_level(logging.DEBUG, logger="modelparallel")
        load({"allow_empty_shards": True}, RANK="1")
        assert caplog.records == []

    def test_no_effect_key_at_default_is_silent(self, caplog):
        caplog.set_level(logging.DEBUG, logger="modelparallel")
        load({"sdp_reduce_bucket_size": 500_000_000, "tensor_parallel_degree": 2})
        assert caplog.records == []


class TestWorldSize:
    """validate_world and shard_size: degrees against the number of processes."""

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
        load(given).validate_world(world)  # raises on failure

    @pytest.mark.parametrize(("given", "world", "factors", "product", "key"), [
        ({"tensor_parallel_degree": 3}, 8, "tensor_parallel_degree=3", 3, "tensor_parallel_degree"),
        ({"pipeline_parallel_degree": 3}, 8, "pipeline_parallel_degree=3", 3,
         "pipeline_parallel_degree"),
        ({"tensor_parallel_degree": 2, "pipeline_parallel_degree": 4}, 4,
         "pipeline_parallel_degree=4 x tensor_parallel_degree=2", 8, "tensor_parallel_degree"),
    ])
    def test_degrees_not_dividing_world(self, given, world, factors, product, key):
        with pytest.raises(ConfigError) as info:
            load(given).validate_world(world)
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
            config.validate_world(8)
        msg = message_for(info.value, key)
        assert msg.startswith(f"{degree} does not divide the data-parallel size 4")
        assert "world size 8" in msg
        assert msg.endswith(f"valid values: {valid}")
        for value in valid.split(", "):  # every listed value really is valid
            load({"tensor_parallel_degree": 2, key: int(value)}).validate_world(8)

    @pytest.mark.parametrize("world", [0, -2, 2.0, True])
    def test_world_size_must_be_positive_int(self, world):
        with pytest.raises(ConfigError) as info:
            load().validate_world(world)
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
        assert config.data_parallel_size(world) == dp
        assert config.shard_size(world) == shard
