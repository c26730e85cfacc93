"""`modelparallel check-config`: exit codes and output for good and bad files, and --list."""

from __future__ import annotations

import dataclasses
import json
import logging
import subprocess
import sys

import pytest

from modelparallel.config import Config
from modelparallel.launch.cli import main

VALID_YAML = "tensor_parallel_degree: 2\npartitions: 2\nmicrobatches: 4\n"


def check_config(capsys, *argv: str) -> tuple[int, str, str]:
    """Run the command in-process; (exit code, stdout, stderr)."""
    with pytest.raises(SystemExit) as info:
        main(["check-config", *argv])
    out, err = capsys.readouterr()
    return info.value.code, out, err


def printed_keys(out: str) -> dict:
    """The JSON object of explicitly set keys that follows the OK line."""
    return json.loads(out[out.index("{"):])


@pytest.fixture
def valid_file(tmp_path):
    path = tmp_path / "mp.yaml"
    path.write_text(VALID_YAML)
    return str(path)


class TestValidFile:
    """A valid file exits 0 and prints the keys it sets, and the layout for --world-size."""

    def test_ok(self, capsys, valid_file):
        code, out, err = check_config(capsys, valid_file)
        assert code == 0
        assert err == ""
        assert out.startswith(f"{valid_file}: OK (3 keys set)\n")
        assert "layout" not in out
        assert printed_keys(out) == {"tensor_parallel_degree": 2, "pipeline_parallel_degree": 2,
                                     "microbatches": 4}

    def test_world_size_prints_layout(self, capsys, valid_file):
        code, out, _ = check_config(capsys, valid_file, "--world-size", "8")
        assert code == 0
        assert ("layout: 8 ranks: dp_replicate=1 x dp_shard=2 x pp=2 x tp=2 (placement DPT)"
                in out.splitlines())

    def test_sagemaker_wrapper(self, capsys, tmp_path):
        path = tmp_path / "sm.json"
        path.write_text(json.dumps({"enabled": True,
                                    "parameters": {"tensor_parallel_degree": 2, "ddp": True}}))
        code, out, _ = check_config(capsys, str(path))
        assert code == 0
        assert f"{path}: OK (2 keys set)" in out
        assert printed_keys(out) == {"tensor_parallel_degree": 2, "ddp": True}


class TestInvalidFile:
    """Problems exit 1 with the message on stderr."""

    def test_unknown_key(self, capsys, tmp_path):
        path = tmp_path / "mp.yaml"
        path.write_text("tensor_paralel_degree: 2\n")
        code, out, err = check_config(capsys, str(path))
        assert code == 1
        assert "OK" not in out
        assert err.startswith(f"{path}: invalid modelparallel configuration")
        assert "tensor_paralel_degree: unknown key" in err
        assert "did you mean 'tensor_parallel_degree'" in err

    def test_degrees_not_dividing_world_size(self, capsys, valid_file):
        code, out, err = check_config(capsys, valid_file, "--world-size", "6")
        assert code == 1
        assert "OK" not in out
        assert ("pipeline_parallel_degree=2 x tensor_parallel_degree=2 = 4 does not divide "
                "the world size 6") in err

    @pytest.mark.parametrize("world", ["0", "-4"])
    def test_world_size_must_be_positive(self, capsys, valid_file, world):
        code, _, err = check_config(capsys, valid_file, "--world-size", world)
        assert code == 1
        assert f"world_size: {world} is not a number of processes" in err

    def test_missing_file(self, capsys, tmp_path):
        path = tmp_path / "missing.yaml"
        code, _, err = check_config(capsys, str(path))
        assert code == 1
        assert "does not exist" in err

    def test_no_file(self, capsys):
        code, out, err = check_config(capsys)
        assert code == 2
        assert out == ""
        assert "give a FILE or --list" in err


def list_lines(out: str) -> dict[str, str]:
    """--list output by key."""
    return {line.split()[0]: line for line in out.splitlines()}


class TestNoEffectAndRefusedKeys:
    """A file setting a no-effect key passes, with the one-line reason logged; a refused
    key fails with the reason."""

    def test_no_effect_key_passes_and_says_why(self, capsys, caplog, tmp_path):
        caplog.set_level(logging.DEBUG, logger="modelparallel")
        path = tmp_path / "mp.yaml"
        path.write_text("ddp_port: 29500\nstatic_mode: true\n")
        code, out, _ = check_config(capsys, str(path))
        assert code == 0
        assert f"{path}: OK (2 keys set)" in out
        msgs = sorted(r.getMessage() for r in caplog.records)
        assert msgs == [
            "ddp_port=29500 has no effect in modelparallel: the default process group uses "
            "the launcher's rendezvous (MASTER_ADDR/MASTER_PORT); data-parallel groups are "
            "sub-groups of it",
            "static_mode=True has no effect in modelparallel: there is no request/response "
            "exchange to skip: every rank runs a fixed torch.distributed.pipelining schedule "
            "each step",
        ]

    def test_refused_key_fails_with_reason(self, capsys, tmp_path):
        path = tmp_path / "mp.yaml"
        path.write_text("horovod: true\n")
        code, out, err = check_config(capsys, str(path))
        assert code == 1
        assert "OK" not in out
        assert ("horovod: True is not supported yet (modelparallel uses torch.distributed, "
                "not Horovod); valid value: False") in err


class TestList:
    """--list prints every key with its default and notes the alias."""

    def test_list(self, capsys):
        code, out, _ = check_config(capsys, "--list")
        assert code == 0
        lines = list_lines(out)
        for key, default in [("tensor_parallel_degree", "1"), ("microbatches", "1"),
                             ("pipeline", "'interleaved'"), ("placement_strategy", "'cluster'"),
                             ("hybrid_shard_degree", "0"), ("memory_weight", "None"),
                             ("sdp_reduce_bucket_size", "500000000")]:
            assert f"default={default} " in lines[key]
        assert "(alias: partitions)" in lines["pipeline_parallel_degree"]

    def test_list_covers_every_key(self, capsys):
        _, out, _ = check_config(capsys, "--list")
        listed = [line.split()[0] for line in out.splitlines()]
        assert listed == list(Config.__dataclass_fields__)

    @pytest.mark.parametrize("f", [f for f in dataclasses.fields(Config)
                                   if f.metadata["no_effect"]], ids=lambda f: f.name)
    def test_list_says_which_keys_have_no_effect_and_why(self, capsys, f):
        _, out, _ = check_config(capsys, "--list")
        line = list_lines(out)[f.name]
        assert line.endswith(f" [no effect here: {f.metadata['no_effect']}]")

    @pytest.mark.parametrize("f", [f for f in dataclasses.fields(Config)
                                   if f.metadata["not_built"]], ids=lambda f: f.name)
    def test_list_says_which_keys_are_refused_and_why(self, capsys, f):
        _, out, _ = check_config(capsys, "--list")
        line = list_lines(out)[f.name]
        assert line.endswith(f" [only the default is accepted: {f.metadata['not_built']}]")

    def test_list_keys_with_an_effect_carry_no_note(self, capsys):
        _, out, _ = check_config(capsys, "--list")
        lines = list_lines(out)
        for f in dataclasses.fields(Config):
            if not (f.metadata["no_effect"] or f.metadata["not_built"]):
                assert "[" not in lines[f.name], f.name
        assert "no effect" not in lines["sdp_gradient_clipping"]
        assert "DistributedOptimizer.step" in lines["sdp_gradient_clipping"]
        assert "default=0 " in lines["tensor_parallel_seed"]
        assert lines["ddp_port"].endswith(
            "[no effect here: the default process group uses the launcher's rendezvous "
            "(MASTER_ADDR/MASTER_PORT); data-parallel groups are sub-groups of it]")
        assert lines["horovod"].endswith(
            "[only the default is accepted: modelparallel uses torch.distributed, not "
            "Horovod]")

    def test_list_with_file_checks_it_too(self, capsys, valid_file):
        code, out, _ = check_config(capsys, "--list", valid_file)
        assert code == 0
        assert "default=" in out and f"{valid_file}: OK" in out


def test_console_script(tmp_path):
    """The real entry point, in a fresh interpreter."""
    path = tmp_path / "mp.yaml"
    path.write_text(VALID_YAML)
    proc = subprocess.run(
        [sys.executable, "-m", "modelparallel", "check-config", str(path), "--world-size", "4"],
        capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    assert f"{path}: OK (3 keys set)" in proc.stdout
    assert "layout: 4 ranks: dp_replicate=1 x dp_shard=1 x pp=2 x tp=2" in proc.stdout


def test_every_problem_is_listed_at_once(capsys, tmp_path):
    path = tmp_path / "mp.yaml"
    path.write_text("tensor_paralel_degree: 2\ncollective_timeout: -5\nmicrobatches: '4'\n")
    code, out, err = check_config(capsys, str(path))
    assert (code, out) == (1, "")
    assert err.splitlines() == [
        f"{path}: invalid modelparallel configuration:",
        f"  - tensor_paralel_degree: unknown key in {path}; did you mean "
        "'tensor_parallel_degree' or 'tensor_parallel_seed' or 'expert_parallel_degree'?",
        "  - microbatches: '4' has type str; expected int",
        "  - collective_timeout: -5 is out of range; must be > 0 and finite (seconds)"]


@pytest.mark.parametrize("name, text, where, problem", [
    ("mp.yaml", "microbatches: 4\n  pipeline: simple\n", "line 2, column 11",
     "mapping values are not allowed here"),
    ("mp.json", '{"microbatches": 4,\n "pipeline" "simple"}\n', "line 2, column 13",
     "Expecting ':' delimiter")])
def test_a_parse_error_names_the_file_and_line(capsys, tmp_path, name, text, where, problem):
    path = tmp_path / name
    path.write_text(text)
    code, out, err = check_config(capsys, str(path))
    assert (code, out) == (1, "")
    assert err.splitlines()[1] == f"  - configuration: cannot parse '{path}', {where}: {problem}"
    assert "<unicode string>" not in err
