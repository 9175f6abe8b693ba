"""What clients and shards share: routing, array codecs, the wire codecs and protocol table, the status
table, specs, optimizer math and id dedup. Imports neither the server nor torch."""
