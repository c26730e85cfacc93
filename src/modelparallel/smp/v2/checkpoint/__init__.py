"""SMP v2's checkpoint modules, ``torch.sagemaker.distributed.checkpoint.*`` (and
``torch.sagemaker.checkpoint.constants``, ``torch.sagemaker.distributed.fsdp.checkpoint``),
built on ``torch.distributed.checkpoint`` and :mod:`modelparallel.checkpoint`.

Submodules, named as SMP names them: ``state_dict_saver`` (``save``, ``async_save``,
``maybe_finalize_async_calls``), ``state_dict_loader`` (``load``), ``async_utils``
(``AsyncCallsQueue``), ``filesystem`` (``DistributedFileSystemWriter`` / ``Reader``,
``path_to_file_system``), ``s3_filesystem`` (``is_s3_uri``, ...), ``state_dict_utils``
(``SMStateDictType``, ``sm_state_dict_type``, ``init_optim_state``,
``compute_auto_checkpoint_interval``), ``constants``, ``fsdp_checkpoint``. See
docs/checkpoint.md.
"""
