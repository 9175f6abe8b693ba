"""Replica groups (``shardps serve --replicas R``): each shard index runs as R processes, one primary and R-1
backups, coordinated through etcd (``coordination``: leases, the primary's key, its epoch). ``member`` is one
process's part: the election, fencing every write with the epoch, the backup's follow loop applying the
primary's records through the replay path, and the primary's side of a follower's stream. The gRPC parts (the
Replicate call, a backup's client of it) are ``shardps.server.rpc.replication``; the records and their quorum
are ``shardps.server.durability.replication``."""
