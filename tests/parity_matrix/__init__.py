"""The parity matrix: every layout the configuration allows, trained against one process.

``space`` describes the configuration space and generates the cases, ``zoo`` builds
the models, ``train`` runs a case on a rank (and the one-process reference),
``compare`` judges it, ``run`` drives worker processes and 2-node launches, and
``python tests/parity_matrix`` runs it all (see docs/testing.md).
"""
