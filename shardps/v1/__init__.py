"""Generated protobuf and gRPC code for the ``shardps.v1`` protocol.

Regenerate with ``python protos/codegen.py``; do not edit by hand.
"""
