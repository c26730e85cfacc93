"""What ``import smdistributed.modelparallel`` gives a script in zero-line mode: the
version it prints (modelparallel's own) and, once imported, ``.torch``."""

from modelparallel.version import __version__

__all__ = ["__version__"]
