"""A run's output is the training's: no profiler or allocator lines from StepMetrics'
memory probe, and a notice that something has no effect here printed once per run
(rank 0, WARNING) rather than once per rank or not at all."""

OFFLOAD_NOTICE = "offload_activations (SMP v1) offloads the checkpointed modules"
NO_EFFECT_NOTICE = "deterministic_server=True has no effect in modelparallel"
TORCH_NOISE = ("USDT", "SyncActivityProfilerHandler", "CPUAllocator",
               "Memory block of unknown size", "unwaited collective")


def test_a_run_with_step_metrics_prints_the_training_and_each_notice_once(modelparallel,
                                                                           script):
    path = script("""
        import torch
        from torch import nn

        import modelparallel as mp

        mp.init({"offload_activations": True, "deterministic_server": True})
        model = mp.shard(nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 1)))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        metrics = mp.observe.StepMetrics()
        for _ in range(3):
            with metrics.step(samples=4) as rec:
                optimizer.zero_grad()
                loss = model(torch.randn(4, 16)).pow(2).mean()
                loss.backward()
                optimizer.step()
                rec.loss = loss
    """)
    ran = modelparallel("run", "--nproc-per-node", 2, path, timeout=300)
    assert ran.code == 0, ran.all
    for noise in TORCH_NOISE:
        assert noise not in ran.all, ran.all
    assert ran.all.count(OFFLOAD_NOTICE) == 1, ran.all
    assert ran.all.count(NO_EFFECT_NOTICE) == 1, ran.all
    assert ran.out.count("| loss ") == 3, ran.all  # the training's lines are all there


WARNING_SCRIPT = """
    import os
    import time
    import warnings

    import torch

    rank = int(os.environ["RANK"])
    time.sleep(0.5 * rank)  # rank 0 warns first
    warnings.warn("the same words on every rank")
    torch.nn.functional.softmax(torch.ones(2, 2))  # torch's own warning, on every rank
    warnings.warn(f"rank {rank} has words of its own")
    print(f"rank {rank} trains", flush=True)
"""
SAME = "UserWarning: the same words on every rank"
TORCH_SAME = "UserWarning: Implicit dimension choice for softmax"


def test_a_warning_every_rank_emits_alike_is_printed_once(modelparallel, script):
    """Criterion: a warning every rank emits with the same text (the script's, torch's)
    is printed once, with its source line once; warnings whose text differs and the
    ranks' own lines are all there, each rank's."""
    ran = modelparallel("run", "--nproc-per-node", 2, script(WARNING_SCRIPT), timeout=300)
    assert ran.code == 0, ran.all
    assert ran.all.count(SAME) == 1, ran.all
    assert ran.all.count('warnings.warn("the same words on every rank")') == 1, ran.all
    assert ran.all.count(TORCH_SAME) == 1, ran.all
    for rank in (0, 1):
        assert ran.all.count(f"UserWarning: rank {rank} has words of its own") == 1, ran.all
        assert f"[rank{rank}]: rank {rank} trains" in ran.out, ran.all


def test_a_warning_is_printed_by_a_rank_the_filter_shows(modelparallel, script):
    """Criterion: with --ranks-filter 1 the shown rank prints the warning both ranks
    emit, although rank 0 emits it first; rank 0's lines are not shown."""
    ran = modelparallel("run", "--nproc-per-node", 2, "--ranks-filter", 1,
                        script(WARNING_SCRIPT), timeout=300)
    assert ran.code == 0, ran.all
    assert ran.all.count(SAME) == 1, ran.all
    assert ran.all.split(SAME)[0].splitlines()[-1].startswith("[rank1]:"), ran.all
    assert "rank 0" not in ran.all and "[rank1]: rank 1 trains" in ran.out, ran.all
