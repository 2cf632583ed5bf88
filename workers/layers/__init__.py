"""Tensor-parallel building blocks shared by every model in ``pagedray.workers.models``.

Each layer takes the ``TPGroup`` at construction, owns only this rank's shard of its weights,
loads that shard itself from a ``CheckpointReader`` (reading only its slice), and performs its
collective explicitly in ``forward``.
"""
