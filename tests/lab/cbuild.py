"""The lab's C parts (the fault proxy, the clock shim), built with the machine's C compiler on first use and kept
per source version in the temp dir."""

from __future__ import annotations

import hashlib
import os
import pathlib
import shutil
import subprocess
import tempfile


def compiled(source: pathlib.Path, name: str, what: str, flags: tuple[str, ...] = (), libs: tuple[str, ...] = (),
             suffix: str = "") -> pathlib.Path:
    """``source`` built into ``<tmp>/<name>-<source hash><suffix>`` (once: a concurrent build of the same source
    writes the same file, put in place atomically); ``what`` names it in errors."""
    digest = hashlib.sha256(source.read_bytes()).hexdigest()[:16]
    out = pathlib.Path(tempfile.gettempdir()) / f"{name}-{digest}{suffix}"
    if out.exists():
        return out
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise RuntimeError(f"{what} needs a C compiler (Debian: gcc)")
    tmp = out.with_name(f"{out.name}.{os.getpid()}.tmp")
    r = subprocess.run([cc, "-O2", "-Wall", *flags, "-o", str(tmp), str(source), *libs], capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"building {what} failed:\n{r.stderr}")
    os.replace(tmp, out)
    return out
