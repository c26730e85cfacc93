"""SMP v1 (``smdistributed.modelparallel.torch``): ``DistributedModel``, ``@smp.step``,
``DistributedOptimizer``, the rank API, ``smp.save`` / ``smp.load``, tensor-parallel
marking and registration, ``smp.amp``, ``smp.optimizers`` and the ``smp.nn`` modules
(``nn/``). ``import modelparallel as smp`` exposes them."""
