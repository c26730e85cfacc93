"""The core appliers: each turns a single-device model into a parallel one, given the
:class:`~modelparallel.context.ParallelContext` (docs/architecture.md). Import the
modules themselves; this package re-exports nothing, so that light modules (the pipeline
schedule rules ``Config`` checks) import without the rest."""
