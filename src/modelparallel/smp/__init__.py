"""The SMP facade: the names SageMaker scripts call (SMP v1, SMP v2, the rank API, the
FSDP1 hook), and the one process-wide state they expect (``smp.state``).

Each name here adapts the core (``parallel``, ``checkpoint``, ``observe``), which takes
a :class:`~modelparallel.context.ParallelContext` as an argument and never reads this
state. ``import modelparallel as smp`` exposes them (docs/architecture.md).
"""
