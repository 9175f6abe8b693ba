"""The client's transport, and the only package of the client that imports grpc: channels, deadlines, retries,
lanes (``shards``: ``Transport``; ``lane``: ``Lane`` and gRPC errors as client exceptions; ``channels``: TLS, tokens,
channels, replica groups' members)."""

from shardps_client.transport.channels import TLS
from shardps_client.transport.lane import Lane, from_rpc_error, from_status, resolve
from shardps_client.transport.shards import CLOSED, Transport, results

__all__ = ["CLOSED", "TLS", "Lane", "Transport", "from_rpc_error", "from_status", "resolve", "results"]
