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
