"""The README documents every `shardps serve` flag with its environment variable and default."""

import pathlib
import re

from shardps.server.ops.cli import SERVE_FLAGS, env_name

README = (pathlib.Path(__file__).resolve().parent.parent / "README.md").read_text()


def test_serve_flag_table_matches_the_cli():
    rows = re.findall(r"^\| `--([a-z-]+)` \| `(SHARDPS_[A-Z_]+)` \| ([^|]+) \|", README, re.M)
    documented = {flag: (env, default.strip()) for flag, env, default in rows}
    assert set(documented) == {f[0] for f in SERVE_FLAGS}
    for flag, _, default, _ in SERVE_FLAGS:
        env, doc_default = documented[flag]
        assert env == env_name(flag)
        if default is None:
            assert doc_default in ("required", "none", "off"), (flag, doc_default)
        else:
            assert _norm(doc_default.strip("`")) == _norm(str(default)), (flag, doc_default, default)


def _norm(value: str) -> str:
    try:
        return f"{float(value):g}"
    except ValueError:
        return value


def test_readme_names_the_test_command_ci_runs():
    ci = (pathlib.Path(__file__).resolve().parent.parent / ".ci" / "run").read_text()
    assert "make test" in ci and "make test" in README
