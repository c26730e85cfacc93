"""Launching: the ``modelparallel`` command line over torch.distributed.run."""
