"""The version of modelparallel (also what ``smdistributed.modelparallel.__version__`` reads)."""

__version__ = "0.1.0"
