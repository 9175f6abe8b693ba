"""Exports served read-only: ``serving.Follower`` loads an export's base and follows its deltas into a shard's
tables (``shardps serve --serve-from``). The export format itself is ``shardps.core.exports``, shared with
the client and the ``shardps export`` command. Imports ``storage`` and ``shardps.core`` only.
"""
