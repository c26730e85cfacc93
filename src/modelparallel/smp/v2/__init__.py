"""SMP v2 (``torch.sagemaker``): the FSDP hooks, activation offloading, the checkpoint
modules (``checkpoint/``), ``tsm.ranker``, ``tsm.grad_norm``, ``tsm.logger``,
``tsm.utils``, the random-state tracker, the refused MoE and context-parallel setups and
the ``tsm.nn`` modules (``nn/``). ``import modelparallel as tsm`` exposes them; the
attributes scripts read from ``tsm.state`` are the shared ``State``'s
(:mod:`modelparallel.smp.state`)."""
