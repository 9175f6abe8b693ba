"""Shared helpers of the benchmarks: workloads, timing, process accounting, output."""

from __future__ import annotations

import json
import os
import pathlib
import sys
import time
from typing import Any, Iterable, Optional

import numpy as np

from shardps.server.ops.launcher import cpu_seconds  # noqa: F401 (the benchmarks' process accounting)

RESULTS = pathlib.Path(__file__).resolve().parent / "results"


def zipf_ids(rng: np.random.Generator, n: int, rows: int, a: Optional[float]) -> np.ndarray:
    """n ids in [0, rows): Zipf(a) ranks scattered over the table, or uniform when a is None."""
    if a is None:
        return rng.integers(0, rows, n)
    ranks = rng.zipf(a, n).astype(np.int64) - 1
    return ((ranks % rows) * 2_654_435_761) % rows


def unique_batches(seed: int, count: int, batch: int, rows: int, a: Optional[float]) -> list[np.ndarray]:
    """Pre-generated batches of unique ids (generated before timing starts)."""
    rng = np.random.default_rng(seed)
    return [np.unique(zipf_ids(rng, batch, rows, a)) for _ in range(count)]


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def median_and_range(ratios: list[float]) -> tuple[float, str]:
    """Median of ratios taken run by run, and their range as printed ("0.81-1.04")."""
    return float(np.median(ratios)), f"{min(ratios):.2f}-{max(ratios):.2f}"


def percentile_ms(samples: list[float], q: float) -> float:
    return float(np.percentile(np.array(samples) * 1e3, q)) if samples else float("nan")


class Progress:
    """A progress bar over benchmark configurations (stderr, so tables stay clean)."""

    def __init__(self, total: int, label: str) -> None:
        self.total, self.label, self.done, self.start = total, label, 0, time.perf_counter()

    def step(self, what: str) -> None:
        self.done += 1
        frac = self.done / max(self.total, 1)
        bar = "#" * int(30 * frac) + "." * (30 - int(30 * frac))
        elapsed = time.perf_counter() - self.start
        end = "\n" if self.done >= self.total or not sys.stderr.isatty() else ""
        print(f"\r{self.label} [{bar}] {self.done}/{self.total} {elapsed:5.0f}s  {what:<50}", end=end, file=sys.stderr,
              flush=True)


def table(rows: list[dict[str, Any]], columns: list[tuple[str, str, str]]) -> str:
    """Render rows as a text table; columns are (key, header, format)."""
    cells = [[("{:" + fmt + "}").format(r[k]) if isinstance(r.get(k), (int, float)) else
              "-" if r.get(k) is None else str(r[k])
              for k, _, fmt in columns] for r in rows]
    widths = [max(len(h), *(len(c[i]) for c in cells)) if cells else len(h) for i, (_, h, _) in enumerate(columns)]
    line = "  ".join(h.rjust(w) for (_, h, _), w in zip(columns, widths))
    out = [line, "-" * len(line)]
    out += ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in cells]
    return "\n".join(out)


def write_outputs(name: str, meta: dict, rows: list[dict], out_dir: Optional[pathlib.Path] = None) -> pathlib.Path:
    """Write results/<name>.json (meta + rows); returns the directory."""
    out = out_dir or RESULTS
    out.mkdir(parents=True, exist_ok=True)
    meta = {**meta, "machine": {"cpus": os.cpu_count(), "python": sys.version.split()[0], "time": time.strftime("%Y-%m-%d %H:%M:%S")}}
    (out / f"{name}.json").write_text(json.dumps({"meta": meta, "results": rows}, indent=2, default=str))
    return out


def plot(path: pathlib.Path, panels: Iterable[tuple[str, str, dict[str, tuple[list, list]]]], ylabel: str) -> None:
    """One PNG with a line panel per (title, xlabel, {series: (xs, ys)})."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = list(panels)
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4), squeeze=False)
    for ax, (title, xlabel, series) in zip(axes[0], panels):
        for label, (xs, ys) in series.items():
            ax.plot(xs, ys, marker="o", label=label)
        ax.set_title(title)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
