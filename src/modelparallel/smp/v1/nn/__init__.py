"""SMP v1's ``smp.nn`` modules (``smdistributed.modelparallel.torch.nn``); scripts reach
them through :mod:`modelparallel.smp.nn`, which also registers their plans."""
