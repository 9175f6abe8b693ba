"""The lab: hosts on one machine for tests and benchmarks (network namespaces, a bridge, faults by name).

It lives under ``tests/`` because it is test equipment: the suite, the benchmarks (``--placement lab``) and the
fault campaign (``tests/chaos``) import it, and nothing installed does (it is not in the wheel; a shard knows
nothing of it). ``python -m tests.lab sweep`` removes what labs whose owner died left behind.

    with Lab(["ctl", "s0", "s1"]) as lab:
        p = lab.spawn("s0", ["shardps", "serve", "--host", lab.address("s0"), ...])
        lab.partition(["s0"], ["s1", "ctl"])        # s0 cut off from the others
        lab.heal()
        proxy = lab.link("ctl", "s1")              # ctl's connections to s1 go through a fault proxy
        proxy.delay(0.1)                           # 100 us each way
"""

from tests.lab.clock import Clock
from tests.lab.disk import Disk, Failpoints
from tests.lab.lab import SUBNET, Host, Lab, LabCallError, LabProcess
from tests.lab.netns import LabUnavailable, enter, leftovers, sweep, why_unavailable
from tests.lab.proxy import Proxy

__all__ = ["SUBNET", "Clock", "Disk", "Failpoints", "Host", "Lab", "LabCallError", "LabProcess", "LabUnavailable",
           "Proxy", "enter", "leftovers", "sweep", "why_unavailable"]
