"""The docs stay true to the code: the generated configuration reference, the environment variables, the
links between pages, the README's length, and the architecture page's list of modules.

Each check is a small function run on the real files and, in a test of its own, on a sample it must
reject, so that none of them can pass by seeing nothing.
"""

from __future__ import annotations

import pathlib
import re
from typing import Iterable

import pytest

from shardps.server.ops import cli, reference

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
README = ROOT / "README.md"
CONFIGURATION = DOCS / "configuration.md"
ARCHITECTURE = DOCS / "architecture.md"
README_MAX_LINES = 200


def _pages() -> list[pathlib.Path]:
    return [README, *sorted(DOCS.glob("*.md"))]


# ---- (a) docs/configuration.md is what the generator writes ------------------------------------------


def test_configuration_reference_is_generated_from_the_cli():
    assert CONFIGURATION.read_text() == reference.configuration_markdown(), (
        "docs/configuration.md is stale: run `make docs`")


def test_the_reference_picks_up_a_new_serve_flag(monkeypatch):
    """A flag added to SERVE_FLAGS reaches the page (with its variable and default), so the page goes stale."""
    monkeypatch.setattr(cli, "SERVE_FLAGS", [*cli.SERVE_FLAGS, ("frobnicate-mb", int, 7, "frobs per shard")])
    monkeypatch.setattr(reference, "SERVE_FLAGS", cli.SERVE_FLAGS)
    text = reference.configuration_markdown()
    assert "| `--frobnicate-mb` | `SHARDPS_FROBNICATE_MB` | int | `7` | frobs per shard |" in text
    assert text != CONFIGURATION.read_text()


def test_the_reference_lists_every_option_of_every_subcommand():
    text = reference.configuration_markdown()
    parser = cli.build_parser()
    for name, sub in reference._subcommands(parser):
        assert f"## `shardps {name}`" in text
        for action in sub._actions:
            for option in action.option_strings:
                if option not in ("-h", "--help"):
                    assert f"`{option}`" in text, (name, option)


def test_the_reference_does_not_depend_on_the_shell(monkeypatch):
    """Some option defaults come from the environment; the page must be the same whatever is set."""
    monkeypatch.setenv("SHARDPS_SHARDS", "9")
    monkeypatch.setenv("SHARDPS_TLS_CA", "/somewhere/ca.pem")
    assert reference.configuration_markdown() == CONFIGURATION.read_text()


# ---- (b) every SHARDPS_* variable the code reads is in the reference ---------------------------------

ENV_NAME = re.compile(r"SHARDPS_[A-Z0-9_]+")


def env_names_in(text: str) -> set[str]:
    return set(ENV_NAME.findall(text))


def undocumented(names: Iterable[str], reference_text: str) -> list[str]:
    """Names the reference does not give. A name ending in "_" (``SHARDPS_TLS_*`` in a comment) is a
    prefix: some documented name must start with it."""
    documented = env_names_in(reference_text)
    missing = []
    for name in sorted(set(names)):
        if name.endswith("_"):
            if not any(d.startswith(name) for d in documented):
                missing.append(name + "*")
        elif name not in documented:
            missing.append(name)
    return missing


def _code_files() -> list[pathlib.Path]:
    files = [*(ROOT / "shardps").rglob("*.py"), *(ROOT / "clients" / "shardps_client").rglob("*.py")]
    return [p for p in files if "v1" not in p.relative_to(ROOT).parts]


def test_every_environment_variable_in_the_code_is_in_the_reference():
    names: set[str] = set()
    for path in _code_files():
        names |= env_names_in(path.read_text())
    assert len(names) >= 8  # SHARDPS_KERNELS, SHARDPS_TOKEN, SHARDPS_TLS_CA, ...: the scan does see them
    assert undocumented(names, reference.configuration_markdown()) == [], (
        "add them to ENVIRONMENT in shardps/server/ops/reference.py, then run `make docs`")


def _everything_that_may_read_a_variable() -> str:
    files = [ROOT / "Makefile", ROOT / ".ci" / "run"]
    for folder in ("shardps", "clients", "tests", "docker", "benchmarks"):
        for p in (ROOT / folder).rglob("*"):
            if p.is_file() and (p.suffix in (".py", ".yaml", ".yml", ".sh") or p.name.startswith("Dockerfile")):
                files.append(p)
    skip = {ROOT / "tests" / "test_docs.py", ROOT / "shardps" / "server" / "ops" / "reference.py"}
    return "\n".join(p.read_text(errors="replace") for p in files if p not in skip and "wheelhouse" not in p.parts)


def test_every_listed_environment_variable_is_read_somewhere():
    """The list in reference.py keeps no variable that nothing reads or sets any more."""
    text = _everything_that_may_read_a_variable()
    listed = [var for _, _, rows in reference.ENVIRONMENT for var, _, _ in rows]
    assert "SHARDPS_KERNELS" in listed and "SHARDPS_KERNELS" in text
    assert [var for var in listed if not re.search(r"\b" + var + r"\b", text)] == []


def test_an_undocumented_variable_is_caught():
    code = 'os.environ.get("SHARDPS_KERNELS"); os.environ["SHARDPS_NOT_A_REAL_SETTING"]  # SHARDPS_TLS_*'
    ref = "| `SHARDPS_KERNELS` | ... |\n| `SHARDPS_TLS_CA` | ... |"
    assert undocumented(env_names_in(code), ref) == ["SHARDPS_NOT_A_REAL_SETTING"]
    assert undocumented({"SHARDPS_TOKENS_"}, ref) == ["SHARDPS_TOKENS_*"]


# ---- (c) every relative link points at a file, and at a heading when it names one ---------------------

FENCE = re.compile(r"^[ \t]*(```|~~~).*?^[ \t]*\1[^\n]*$", re.M | re.S)
CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1", re.S)
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^(#{1,6})[ \t]+(.+?)[ \t]*#*[ \t]*$", re.M)


def _prose(markdown: str) -> str:
    """The text with code blocks and code spans blanked out (links there are not links)."""
    return CODE_SPAN.sub("", FENCE.sub("", markdown))


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lowercase, punctuation dropped, spaces to '-'."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading keeps its text
    text = re.sub(r"<[^>]+>", "", text).strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(markdown: str) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for _, title in HEADING.findall(FENCE.sub("", markdown)):
        base = slug(title)
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def broken_links(markdown: str, page: pathlib.Path) -> list[str]:
    """Relative links of ``markdown`` (the text of ``page``) whose file or heading does not exist."""
    bad = []
    for target in LINK.findall(_prose(markdown)):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):  # http:, https:, mailto:
            continue
        path_part, _, anchor = target.partition("#")
        if not path_part:  # a heading of this page
            if anchor not in anchors(markdown):
                bad.append(f"{target} (no heading #{anchor} here)")
            continue
        dest = (page.parent / path_part).resolve()
        if not dest.exists():
            bad.append(f"{target} (no file {dest})")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest.read_text()):
            bad.append(f"{target} (no heading #{anchor} in {dest.name})")
    return bad


@pytest.mark.parametrize("page", _pages(), ids=lambda p: p.name)
def test_relative_links_resolve(page):
    assert broken_links(page.read_text(), page) == []


def test_the_pages_link_to_each_other():
    """Every docs page is reachable from the README, so a reader finds it."""
    readme = README.read_text()
    assert [p.name for p in DOCS.glob("*.md") if f"(docs/{p.name}" not in readme] == []


def test_the_link_checker_catches_broken_links():
    page = DOCS / "sample.md"  # never written: links resolve against docs/
    sample = "\n".join([
        "# A title, with `code` & punctuation!",
        "## Step 2: go",
        "[ok](operations.md) [ok](../README.md#two-commands) [ok](#a-title-with-code--punctuation)",
        "[ok](#step-2-go) [ok](https://example.com/missing.md)",
        "[gone](no-such-page.md) [wrong](operations.md#no-such-heading) [self](#nowhere)",
        "`[in code](no-such-file.md)`",
        "```", "[in a block](also-missing.md)", "```",
    ])
    assert [b.split(" ")[0] for b in broken_links(sample, page)] == [
        "no-such-page.md", "operations.md#no-such-heading", "#nowhere"]


def test_slugs_follow_githubs_rules():
    assert slug("Durability and faults") == "durability-and-faults"
    assert slug("`shardps serve`") == "shardps-serve"
    assert slug("End to end (DLRM)") == "end-to-end-dlrm"
    assert slug("Security: TLS, tokens, threat model") == "security-tls-tokens-threat-model"
    assert anchors("# A\n## A\n```\n# not a heading\n```\n") == {"a", "a-1"}


# ---- (d) the README stays a five-minute read ----------------------------------------------------------


def too_long(text: str, limit: int = README_MAX_LINES) -> bool:
    return len(text.splitlines()) > limit


def test_readme_is_short():
    lines = len(README.read_text().splitlines())
    assert not too_long(README.read_text()), f"README.md has {lines} lines; move detail to docs/ (at most {README_MAX_LINES})"
    assert too_long("line\n" * (README_MAX_LINES + 1)) and not too_long("line\n" * README_MAX_LINES)


def test_readme_names_the_commands_ci_and_the_demo_run():
    readme = README.read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    assert "make test" in ci and "make test" in readme
    assert "make demo" in readme


# ---- (e) the architecture page names every module ---------------------------------------------------


def modules() -> list[str]:
    """Every module of shardps (but its generated code) and of the client, as paths from the repository root."""
    found = [*(ROOT / "shardps").rglob("*.py"), *(ROOT / "clients" / "shardps_client").rglob("*.py")]
    rel = [p.relative_to(ROOT) for p in found]
    return sorted(str(p.as_posix()) for p in rel if not {"v1", "__pycache__"} & set(p.parts))


def unnamed(paths: Iterable[str], text: str) -> list[str]:
    return [p for p in paths if not re.search(r"(?<![\w/.])" + re.escape(p) + r"(?![\w/]|\.\w)", text)]


def test_architecture_names_every_module():
    found = modules()
    assert "shardps/server/ops/cli.py" in found and "clients/shardps_client/client.py" in found
    missing = unnamed(found, ARCHITECTURE.read_text())
    assert missing == [], f"docs/architecture.md does not name {missing}: give each a line with its job"


def test_a_module_missing_from_the_architecture_is_caught():
    text = "- `shardps/server/rpc/fair.py`: fair shares\n- `shardps/core/wire.py` hand-written codecs"
    assert unnamed(["shardps/server/rpc/fair.py", "shardps/core/wire.py"], text) == []
    assert unnamed(["shardps/core/ids.py", "shardps/server/rpc/auth.py"], text) == [
        "shardps/core/ids.py", "shardps/server/rpc/auth.py"]
    assert unnamed(["shardps/core/ids.py"], "`shardps/core/ids.pyc` and `shardps/core/ids.py.bak`") == [
        "shardps/core/ids.py"]
