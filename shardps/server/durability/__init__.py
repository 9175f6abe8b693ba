"""What survives a restart: the write-ahead ``wal`` (segments, group commit, recovery), checkpoint files
(``checkpoints``: atomic snapshots and their headers), the durability ``modes`` (``none``, ``checkpoint``,
``log``) with the records they keep, and the ``gate`` that holds updates back during a two-phase checkpoint.
Imports ``storage`` and ``shardps.core`` only.

Public names: ``durability.modes.make`` / ``MODES``, ``durability.wal.WriteAheadLog``,
``durability.checkpoints.load_newest``, ``durability.gate.CheckpointGate``.
"""
