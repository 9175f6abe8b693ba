"""The fault campaign, in the manner of Jepsen: clients recording histories (``history``, ``workload``), faults by
name on a cluster in the lab (``cluster``, ``nemesis``, ``reshard``), named, seeded, bounded scenarios
(``scenarios``), sessions run and checked (``runner``, ``checkers``). ``python -m tests.chaos`` runs it
(``make chaos``: every scenario at length; ``--short``: CI's version). docs/reliability.md has the results."""
