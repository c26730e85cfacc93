"""SMP v2's ``tsm.nn`` modules (``torch.sagemaker.nn.attn``,
``torch.sagemaker.tensor_parallel.transformer``); scripts reach them through
:mod:`modelparallel.smp.nn`, which also registers their plans."""
