"""What an operator runs: the ``shardps`` command line (``cli``), the local ``launcher`` (``shardps
cluster``), throwaway development ``certs``, the ``shardps stats`` ``report`` and offline ``reshard``.
The top of the server: imports ``rpc`` and everything below it; nothing imports it.
"""
