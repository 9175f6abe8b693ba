"""``shardps reshard`` as an operator runs it, on the control host, moving slots onto the campaign's spare group
(started with ``--join``) while faults hit; killed with SIGKILL and resumed (``--resume``) as an operator would."""

from __future__ import annotations

import sys
import time
from typing import Optional

from tests.chaos.cluster import ROOT, ChaosCluster
from tests.lab import LabProcess


class ReshardRun:
    def __init__(self, cluster: ChaosCluster, batch_slots: int = 128) -> None:
        self.cluster = cluster
        self.batch_slots = batch_slots
        self.journal = cluster.lab.dir / "reshard.json"
        self.proc: Optional[LabProcess] = None
        self.runs = 0
        self.finished = False

    def start(self, resume: bool = False) -> None:
        spare = self.cluster.group(self.cluster.spec.groups)
        what = ["--resume"] if resume else ["--add-address", "|".join(m.address for m in spare)]
        self.runs += 1
        self.proc = self.cluster.lab.spawn("ctl", [
            sys.executable, "-m", "shardps", "reshard", "--cluster-file", str(self.cluster.cluster_file), *what,
            "--journal", str(self.journal), "--batch-slots", str(self.batch_slots), "--timeout", "10"],
            cwd=str(ROOT), log=str(self.cluster.lab.dir / f"reshard-{self.runs}.log"))

    def kill(self) -> None:
        if self.proc is not None and self.proc.alive():
            self.proc.stop(9)

    def done(self) -> bool:
        return self.proc is not None and not self.proc.alive() and self.proc.popen.returncode == 0

    def finish(self, timeout: float = 240.0) -> None:
        """Let the reshard end; resumed again (as an operator would) whenever it stopped without finishing."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.alive():
                time.sleep(0.5)
                continue
            if self.proc.popen.returncode == 0:
                self.finished = True
                return
            time.sleep(1.0)
            self.start(resume=True)
        raise TimeoutError(f"the reshard did not finish in {timeout:.0f} s: {self.proc.log()[-2000:] if self.proc else ''}")
