"""Fuzzing the shard's wire surface: request generators, a harness, a crash check, a report.

Generators (Hypothesis strategies of raw request bytes) cover every method of
``shardps.v1.Shard``: valid messages built from the generated classes with
ordinary and extreme field values, mutations of valid serialized messages at
the protobuf wire level (duplicated fields, non-minimal and oversized varints,
unknown fields, wrong wire types, groups, lengths past the end, packed and
unpacked repeated fields, at any depth with the enclosing lengths fixed up) and
at the byte level (truncation, bit flips, inserted and deleted bytes), and
random bytes.

The harness sends those bytes to a real shard process (``tests/procs.py``)
through a generic gRPC channel (bytes in, bytes out) and checks after every
call that the status is one a client may legitimately get (never INTERNAL or
UNKNOWN), that a refused call changed nothing (shard version, a probe pull of
table ``t`` and of dense tensor ``d``), that the process is alive and below a
memory bound. ``crash_roundtrip`` sends pushes to a shard with ``--durability
log``, kills it with SIGKILL and checks that it restarts holding exactly the
state it acknowledged.

Modules, each importing only those above it:

- ``target``: the service's methods; the tables t and d a fuzzed shard holds
- ``wire``: the raw protobuf wire format (varints, fields, parsing)
- ``values``: strategies of primitive field values
- ``tensors``: strategies of Tensor messages (consistent, wrong, lying)
- ``data_requests``, ``admin_requests``: strategies of valid requests
- ``generators``: the valid requests of every input type
- ``mutations``: structural and byte-level mutations of serialized messages
- ``payloads``: what one fuzzed call sends (valid, mutated or random bytes)
- ``regressions``: the two exact pushes that bricked a restarting shard
- ``oracle``: the status codes a client may get; acknowledged pushes; protobuf against the shard's decoder
- ``memory``: the shard's RSS, watched
- ``report``: failures, and the table of status codes per method
- ``driver``: the shard process, raw calls, the state probe
- ``harness``: one call at a time, checked; restarts after crashes
- ``runner``: Hypothesis examples of every method through the harness
- ``crash``: kill -9 after pushes, and the restart that must hold what was acknowledged

Report mode::

    python -m tests.fuzz --examples 400 --seed 1     # or SHARDPS_FUZZ_EXAMPLES / SHARDPS_FUZZ_SEED

starts a shard, runs the examples of every method, prints a table of method x
status code and the peak RSS, and exits non-zero on any failure.
"""
