"""``modelparallel plan`` and ``check-config --model`` as a user runs them: the JSON
form's fields, the table, the layout search, and the errors for bad input."""

import json

MODEL = "examples/plan/models.py:tiny_gpt"
WORKLOAD = ("--model", MODEL, "--batch-size", 2, "--seq-len", 16)


def test_json_has_every_rank_its_memory_parts_and_the_bytes_per_group(modelparallel, tmp_path):
    config = tmp_path / "layout.json"
    config.write_text(json.dumps({"tensor_parallel_degree": 2, "hybrid_shard_degree": 2}))
    ran = modelparallel("plan", *WORKLOAD, "--config", config, "--world-size", 4, "--json")
    assert ran.code == 0, ran.all
    plan = json.loads(ran.out)
    assert [r["rank"] for r in plan["per_rank"]] == [0, 1, 2, 3]
    for r in plan["per_rank"]:
        parts = r["param_bytes"] + r["grad_bytes"] + r["optimizer_bytes"] + r["activation_bytes"]
        assert r["peak_bytes"] == parts > 0
        assert r["optimizer_bytes"] > 2 * r["param_bytes"] - 1024  # AdamW: two moments + steps
        # rdp: FSDP's per-step flags of parameters used (parallel/unused_grads.py)
        assert set(r["comm_bytes"]) == {"tp", "dp_shard", "rdp"}
        assert r["comm_bytes"]["rdp"] < 1024 < r["comm_bytes"]["dp_shard"]
    assert set(plan["comm_bytes_per_step"]) == {"tp", "dp_shard", "rdp"}
    assert plan["estimate"]["step_s"] > 0


def test_table_and_check_config_plan_the_same_layout(modelparallel, tmp_path):
    config = tmp_path / "layout.json"
    config.write_text(json.dumps({"pipeline_parallel_degree": 2, "microbatches": 2}))
    planned = modelparallel("plan", *WORKLOAD, "--config", config, "--world-size", 2)
    checked = modelparallel("check-config", config, "--world-size", 2, *WORKLOAD)
    assert planned.code == 0 and checked.code == 0, planned.all + checked.all
    table = planned.out[planned.out.index("plan: 2 ranks"):]
    assert "pipeline partition" not in planned.out, "the simulated script's prints leak"
    lines = table.splitlines()
    assert lines[0].startswith("plan: 2 ranks, pp 2, tp 1"), table
    assert [line.split()[1] for line in lines[2:4]] == ["0", "1"], "pipeline stages 0, 1"
    assert "collectives per step" in table and "pp " in table and "estimated step:" in table
    assert table.split("estimated step:")[0] in checked.out


def test_search_ranks_the_layouts_that_fit_and_says_why(modelparallel):
    ran = modelparallel("plan", *WORKLOAD, "--world-size", 2, "--memory-per-device", "1.5M")
    assert ran.code == 0, ran.all
    rows = ran.out.splitlines()
    head = next(i for i, line in enumerate(rows) if line.startswith("layout"))
    table = rows[head + 1:head + 5]
    assert len(table) == 4, ran.out  # pp 1 x (tp 1, 2) x shard, pp 2: every layout of 2
    fits = [r for r in table if "per device" not in r]
    assert fits and all("> 1.50 MiB per device" in r for r in table if r not in fits), ran.out
    assert ran.out.count("best: ") == 1 and fits[0].split("  ")[0] in ran.out.split("best: ")[1]
    nothing = modelparallel("plan", *WORKLOAD, "--world-size", 2, "--memory-per-device", "1K")
    assert nothing.code == 1 and "no layout fits" in nothing.out, nothing.all


def test_bad_input_gets_one_clear_line(modelparallel, tmp_path):
    ran = modelparallel("plan", "--model", "nowhere.py:f", "--batch-size", 1, "--seq-len", 4,
                        "--world-size", 2)
    assert ran.code == 2 and "no file" in ran.err and "nowhere.py" in ran.err, ran.all
    ran = modelparallel("plan", "--model", "examples/plan/models.py:missing", "--batch-size",
                        1, "--seq-len", 4, "--world-size", 2)
    assert ran.code == 2 and "has no function missing" in ran.err, ran.all
    ran = modelparallel("plan", "--model", MODEL, "--world-size", 2)
    assert ran.code == 2 and "needs --batch-size and --seq-len" in ran.err, ran.all
    config = tmp_path / "bad.json"
    config.write_text(json.dumps({"tensor_parallel_degree": 3}))
    ran = modelparallel("plan", *WORKLOAD, "--config", config, "--world-size", 2)
    assert ran.code == 2 and "tensor_parallel_degree" in ran.err, ran.all
    pipeline = tmp_path / "pp.json"
    pipeline.write_text(json.dumps({"pipeline_parallel_degree": 2}))
    ran = modelparallel("plan", *WORKLOAD, "--config", pipeline, "--world-size", 2, "--api",
                        "v2")
    assert ran.code == 2 and "--api v2 (transform + shard) has no pipeline" in ran.err, ran.all
    ran = modelparallel("check-config", pipeline, *WORKLOAD)
    assert ran.code == 2 and "--model needs a configuration FILE and --world-size" in ran.err, \
        ran.all
    model = tmp_path / "reads.py"
    model.write_text(
        "import torch\n"
        "from modelparallel.models.gpt import GPT, GPTConfig\n"
        "class Reads(GPT):\n"
        "    def forward(self, idx):\n"
        "        n = int(idx.max())  # data-dependent\n"
        "        return super().forward(idx)\n"
        "def build():\n"
        "    return Reads(GPTConfig(vocab_size=64, d_model=32, n_layers=1, n_heads=2))\n")
    ran = modelparallel("plan", "--model", f"{model}:build", "--batch-size", 1, "--seq-len", 4,
                        "--world-size", 1)
    assert ran.code == 2, ran.all
    assert f"{model}:5: n = int(idx.max())" in ran.err and "cannot know" in ran.err, ran.err
    assert "Traceback" not in ran.err


def test_search_lists_a_layout_the_batch_cannot_split_and_ranks_the_others(modelparallel):
    # pp 2 needs 2 microbatches; a batch of 1 row does not split into them
    ran = modelparallel("plan", "--model", MODEL, "--batch-size", 1, "--seq-len", 16,
                        "--world-size", 2, "--memory-per-device", "80G")
    assert ran.code == 0, ran.all
    assert "Traceback" not in ran.err and "[rank" not in ran.all, ran.err
    rows = ran.out.splitlines()
    head = next(i for i, line in enumerate(rows) if line.startswith("layout"))
    table = rows[head + 1:head + 5]
    assert table[-1].split() == [
        "pp", "2,", "tp", "1,", "hybrid_shard", "1,", "mb", "2", "-", "-", "-", "-", "not",
        "possible:", "a", "batch", "of", "1", "rows", "per", "rank", "does", "not", "split", "into",
        "microbatches=2", "equal", "parts"], ran.out
    assert all("not possible" not in row for row in table[:3]), ran.out
    assert "best: pp 1" in ran.out and "among the 3 layouts that fit" in ran.out, ran.out


def test_bad_option_values_get_one_line_and_exit_2(modelparallel):
    for option, value, accepted in [
            ("--memory-per-device", "lots", "with an optional suffix K, M, G or T"),
            ("--world-size", "0", "give a whole number >= 1")]:
        args = {"--world-size": "2", "--memory-per-device": "1G", option: value}
        ran = modelparallel("plan", *WORKLOAD, *[a for kv in args.items() for a in kv])
        assert ran.code == 2, ran.all
        assert ran.err.count("\n") == 1, ran.err
        assert ran.err.startswith(f"modelparallel plan: {option} ") and value in ran.err, ran.err
        assert accepted in ran.err, ran.err


def test_check_config_prints_ok_only_when_the_plan_works_too(modelparallel, tmp_path):
    config = tmp_path / "layout.json"
    config.write_text(json.dumps({"tensor_parallel_degree": 2}))
    ran = modelparallel("check-config", config, "--world-size", 2, "--model", MODEL)
    assert ran.code == 2, ran.all
    assert ran.out == "", "no OK before the error"
    assert ran.err == ("modelparallel check-config: the planner needs --batch-size and "
                       "--seq-len\n"), ran.err


def test_a_search_over_tensor_parallel_layouts_ends_without_torchs_warnings(modelparallel):
    # a tensor-parallel step gathers each rank's row count, a one-element tensor: fake
    # tensors carry its value and ran the collective for real, whose work torch then
    # reported at exit as "there are still N unwaited collective calls"
    ran = modelparallel("plan", *WORKLOAD, "--world-size", 2, "--memory-per-device", "80G")
    assert ran.code == 0, ran.all
    assert "pp 1, tp 2, hybrid_shard 1 " in ran.out, ran.out
    assert "unwaited collective" not in ran.all, ran.err
    assert ran.err == "", ran.err
