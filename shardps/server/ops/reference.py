"""The configuration reference, ``docs/configuration.md``, rendered from the one flag list.

Nothing in that page is written by hand: ``shardps serve``'s flags come from ``cli.SERVE_FLAGS`` (each
with its ``SHARDPS_<FLAG>`` variable, ``cli.env_name``), the other subcommands' options from the parser
``cli.build_parser()`` builds (their subparsers, walked), and the environment variables that are not
serve flags from ``ENVIRONMENT`` below. A flag added to the CLI appears at the next ``make docs``; a
variable some code starts to read goes into ``ENVIRONMENT`` (``tests/test_docs.py`` fails until it is
listed, and until the page is regenerated)::

    python -m shardps.server.ops.reference > docs/configuration.md
    python -m shardps.server.ops.reference --write            # the same, what `make docs` runs
    python -m shardps.server.ops.reference --check            # exit code 1 when the page is stale

Imports only the command line and the standard library (no torch, no numba: it runs anywhere).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import sys
from typing import Iterator, Optional, Sequence

from shardps.server.ops.cli import SERVE_FLAGS, build_parser, env_name

DEFAULT_PATH = os.path.join("docs", "configuration.md")

# Every environment variable shardps reads besides the serve flags' SHARDPS_<FLAG>: (group, intro,
# [(variable, read by, meaning)]). Keep it to what the code reads; tests/test_docs.py checks that every
# SHARDPS_* name in shardps/ and clients/shardps_client/ is here or among the serve flags.
ENVIRONMENT: list[tuple[str, str, list[tuple[str, str, str]]]] = [
    ("Every process", "Shards, clients and the command-line tools.", [
        ("SHARDPS_KERNELS", "`shardps.core.kernels` (shards, clients, `shardps reshard`)",
         "which code runs the per-row loops: `auto` (default: the kernels compiled ahead of time where "
         "`python -m shardps.core.kernels` built them, else numba's; the numpy references when numba is missing), "
         "`aot` (the ahead-of-time module; an error when it is not built or stale), `numba` (numba's kernels, "
         "compiled or loaded from its cache at run time; an error when numba is missing) or `numpy` "
         "(the plain-numpy references)"),
        ("SHARDPS_TUNE_MALLOC", "`shardps serve`, `Client` (`shardps.core.memory.tune_malloc`)",
         "`0` leaves glibc's malloc settings alone; otherwise M_MMAP_THRESHOLD is raised to 32 MiB and "
         "M_TRIM_THRESHOLD set to 16 MiB at start, so message-sized buffers stay in the heap "
         "(see [performance](performance.md#performance-notes))"),
        ("SHARDPS_HUGEPAGES", "`shardps serve` (`shardps.core.memory.zeros`)",
         "`0` leaves a shard's large arrays (tables' rows, optimizer state and ids of 16 MiB and up) on the "
         "kernel's default pages; otherwise (the default) they ask for transparent huge pages (`MADV_HUGEPAGE`): "
         "a pull and a push on a 1 GB table took 11-25% less CPU a row (see "
         "[performance](performance.md#performance-notes))"),
        ("SHARDPS_PREFAULT", "`shardps serve` (`shardps.core.memory.populate`, `RowStore`)",
         "`0` leaves a growing table's pages to be made by its rows' first writes; otherwise (the default, on "
         "Linux 5.14 and later) a thread makes the pages of a table's next rows ahead of them "
         "(`MADV_POPULATE_WRITE`): up to an eighth of its reserved rows, then a quarter of those it holds, "
         "at most 32 MiB "
         "a table and 64 MiB in all of a shard's tables (each its share), never past what the memory budget has left (see [performance](performance.md#performance-notes))"),
        ("SHARDPS_DATA_REGIONS", "`Client` (`shardps_client.data_plane`)",
         "`0`: the client asks its shards for no shared-memory regions (its data goes through the Unix socket); "
         "otherwise (the default) a connection over a shard's Unix socket without TLS asks for one: a pull's answer "
         "of 64 KiB to 2 MiB is written into it by the shard, and a push that trails a pull (`read_your_writes=False`) "
         "is built in it by the client (see [protocol](protocol.md#the-data-plane-zeromq))"),
        ("SHARDPS_ZMQ_IN_PLACE", "`shardps serve`, `Client` (`shardps.core.zmsg`)",
         "`0` builds every data-plane message as a Python buffer copied into libzmq's at each send; otherwise "
         "(the default) messages of 64 KB or more (a push's rows, a pull's answer) are built in libzmq's own "
         "message memory and sent from it without a copy (see [performance](performance.md#the-data-plane-zeromq-against-grpc-streams))"),
    ]),
    ("Clients and client-side tools", "Read when the code or the command line gives no value.", [
        ("SHARDPS_TLS_CA", "`Client` (when `tls=None`), `shardps-health`, `shardps health`, `stats`, `export` "
         "(default of `--tls-ca`)",
         "the CA of the shards' certificates (PEM file); when set, the client connects with TLS"),
        ("SHARDPS_TLS_CLIENT_CERT", "the same (the tools' `--tls-cert`)",
         "mutual TLS: this client's certificate (PEM file)"),
        ("SHARDPS_TLS_CLIENT_KEY", "the same (the tools' `--tls-key`)", "mutual TLS: this client's key (PEM file)"),
        ("SHARDPS_TOKEN_FILE", "`Client` (when `token=None`), `shardps stats`, `shardps export`",
         "a file holding the bearer token every call carries (wins over `SHARDPS_TOKEN`); a token never goes "
         "on a command line, which `ps` shows to every user"),
        ("SHARDPS_TOKEN", "the same", "the bearer token itself, when `SHARDPS_TOKEN_FILE` is not set"),
        ("SHARDPS_DATA_PLANE", "`Client` (when `data_plane=None`)",
         "`zmq` (default: pulls and pushes over a shard's data plane, ZeroMQ, when it has one, else on a gRPC "
         "stream; a Unix socket to a shard on this machine), `zmq-tcp` (the data plane always over TCP) or `grpc` "
         "(on a gRPC stream per shard)"),
        ("SHARDPS_SHARDS", "`shardps cluster`", "default of `--shards` (2)"),
        ("RANK", "`Client` (when `rank=None`)", "this worker's rank, as torchrun sets it"),
        ("WORLD_SIZE", "`Client` (when `world_size=None`)", "the number of workers, as torchrun sets it"),
        ("OMP_NUM_THREADS", "`Client(torch_threads=\"auto\")`",
         "when set, the client leaves torch's intra-op threads alone (otherwise, next to shards on this machine, "
         "it sets one thread per core they leave free)"),
    ]),
    ("The examples", "`clients/examples/`: set by the launching process for the workers it starts.", [
        ("SHARDPS_ADDRESSES", "every example's workers (`clients/examples/common.py`)",
         "comma-separated shard addresses, in index order; wins over `--cluster-file` and `--addresses`"),
        ("SHARDPS_RESULTS_DIR", "`clients/examples/dlrm.py`",
         "directory where each worker writes `rank<r>.json` (samples/s, AUC) for the launcher to report"),
    ]),
    ("Deployment", "`docker/compose.yaml`, `docker/compose.tls.yaml` and the images "
     "(see [deployment](deployment.md)).", [
        ("SHARDPS_BASE_IMAGE", "Compose (build argument `BASE_IMAGE`)",
         "base image of both images (default `python:3.11-slim`; `make docker-base` builds "
         "`shardps-base:bookworm` from Debian's mirror)"),
        ("SHARDPS_PIP_SOURCE", "Compose (build argument `PIP_SOURCE`)",
         "`index` (default) or `wheelhouse`: install only from `docker/wheelhouse/`, no network "
         "(`make wheelhouse` fills it)"),
        ("SHARDPS_ROWS", "Compose's trainer", "the DLRM run's `--rows` (default 1000000)"),
        ("SHARDPS_TRAIN", "Compose's trainer", "the DLRM run's `--train` samples (default 400000)"),
        ("SHARDPS_TEST", "Compose's trainer", "the DLRM run's `--test` samples (default 100000)"),
        ("SHARDPS_LOCAL_THREADS", "Compose's trainer",
         "torch threads of the DLRM run's local baseline, `--local-threads` (default 0: one per core; 1 where "
         "the shards share the trainer's cores, whose OpenMP threads otherwise wait on each other)"),
        ("SHARDPS_SECRETS", "`docker/compose.tls.yaml`",
         "directory of TLS files and tokens mounted at `/run/secrets` (default `docker/secrets`)"),
        ("SHARDPS_TRAINER_TOKEN", "`docker/compose.tls.yaml`",
         "the token file in `/run/secrets` the trainer uses (default `admin.token`, which may create tables; "
         "`trainer.token` once they exist)"),
        ("NUMBA_CACHE_DIR", "numba, in the images (`/opt/numba-cache`)",
         "where the compiled kernels are cached; the image's user owns it, so a shard loads them instead of "
         "compiling them at each start"),
    ]),
    ("Development", "Tests and `make` targets (see [development](development.md)).", [
        ("SHARDPS_FUZZ_EXAMPLES", "`tests/test_fuzz.py`, `tests/test_fuzz_auth.py`, `python -m tests.fuzz`",
         "generated requests per method (tests: 35, `python -m tests.fuzz`: 100; `make fuzz` passes `FUZZ_EXAMPLES`, "
         "1000)"),
        ("SHARDPS_FUZZ_SEED", "the fuzz tests, `tests/test_wire_differential.py`",
         "the Hypothesis seed (default 0; `make fuzz` passes `FUZZ_SEED`, 1)"),
        ("SHARDPS_WIRE_EXAMPLES", "`tests/test_wire_differential.py`",
         "examples per push type (default 20 x `SHARDPS_FUZZ_EXAMPLES`)"),
        ("SHARDPS_FAIR_PAIRS", "`tests/test_fairness.py`",
         "windows beside each bad client (default 2; `make fairness` passes `FAIR_PAIRS`, 6)"),
        ("SHARDPS_FAIR_WINDOW_S", "`tests/test_fairness.py`",
         "seconds per window (default 1.2; `make fairness` passes `FAIR_WINDOW_S`, 3)"),
        ("SHARDPS_DOCKER_TEST", "`tests/test_containers.py`",
         "`auto` (default: run where a Docker engine can be used or started, else skip saying why), "
         "`require` (fail instead of skipping: `make docker-test`) or `0` (skip)"),
        ("SHARDPS_REQUIRE_ETCD", "the replica groups' and resharding tests",
         "`1`: a missing `etcd` binary fails them instead of skipping (`.ci/run` sets it)"),
        ("SHARDPS_REQUIRE_LAB", "the lab's tests (`tests/test_lab*.py`, the fault campaign's short runs)",
         "`1`: a machine where no lab can be made (not root, no `ip`/`nft`) fails them instead of skipping "
         "(`.ci/run` sets it)"),
        ("DOCKER_HOST", "`tests/test_containers.py`",
         "the Docker engine to use; without one that answers, the test starts `dockerd` itself (as root)"),
    ]),
]

# The option of another subcommand without help text of its own, when `shardps serve` has the same flag.
_SERVE_HELP = {flag: help_ for flag, _, _, help_ in SERVE_FLAGS}
_ENV_IN_HELP = re.compile(r"\s*\[env (SHARDPS_[A-Z0-9_]+)\]")


def configuration_markdown() -> str:
    """docs/configuration.md: every flag, option and environment variable, with default and meaning."""
    with _without_shardps_environment():  # some option defaults are read from the environment
        parser = build_parser()
    out = [
        "# Configuration reference",
        "",
        "<!-- Generated by `python -m shardps.server.ops.reference --write` (`make docs`) from "
        "shardps/server/ops/cli.py and the ENVIRONMENT list in shardps/server/ops/reference.py. "
        "Do not edit: tests/test_docs.py compares this file with the generator's output. -->",
        "",
        "Every `shardps` flag, every option of the other commands and every environment variable, with its "
        "default and meaning. For what the settings do together see [operations](operations.md), "
        "[security](security.md), [durability](durability.md) and [serving](serving.md).",
        "",
        "- [`shardps serve`](#shardps-serve)",
        *(f"- [`shardps {name}`](#shardps-{name})" for name, _ in _subcommands(parser) if name != "serve"),
        "- [Environment variables](#environment-variables)",
        "",
        *_serve_section(),
    ]
    for name, sub in _subcommands(parser):
        if name != "serve":
            out += _command_section(name, sub, _command_help(parser, name))
    out += _environment_section()
    return "\n".join(out).rstrip() + "\n"


def _serve_section() -> list[str]:
    out = [
        "## `shardps serve`",
        "",
        "Runs one shard until SIGTERM or SIGINT, then lets in-flight calls finish and writes a final "
        "checkpoint (with `--data-dir`). On start it restores the newest valid checkpoint in its data dir "
        "(and replays its log). Every flag can also be set with its environment variable; a flag on the "
        "command line wins. Each shard also serves the standard `grpc.health.v1.Health` service (overall "
        "and for `shardps.v1.Shard`).",
        "",
        "| flag | environment variable | value | default | meaning |",
        "| --- | --- | --- | --- | --- |",
    ]
    for flag, cast, default, help_ in SERVE_FLAGS:
        shown = "required" if default is None and "(required)" in help_ else _default(default)
        out.append(_row(f"`--{flag}`", f"`{env_name(flag)}`", _type_name(cast), shown, _text(help_)))
    return out + [""]


def _command_section(name: str, sub: argparse.ArgumentParser, help_: str) -> list[str]:
    out = [f"## `shardps {name}`", "", f"`{_usage(name, sub)}`", ""]
    if help_:
        out += [_text(help_[0].upper() + help_[1:]) + ".", ""]
    out += ["| option | environment variable | value | default | meaning |", "| --- | --- | --- | --- | --- |"]
    for action in sub._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        meaning, env = _meaning(action)
        out.append(_row(_option(action), f"`{env}`" if env else "", _value(action), _action_default(action),
                        meaning))
    return out + [""]


def _environment_section() -> list[str]:
    out = [
        "## Environment variables",
        "",
        "Besides the `SHARDPS_<FLAG>` of every [`shardps serve`](#shardps-serve) flag:",
        "",
    ]
    for group, intro, rows in ENVIRONMENT:
        out += [f"### {group}", "", intro, "", "| variable | read by | meaning |", "| --- | --- | --- |"]
        out += [_row(f"`{var}`", who, what) for var, who, what in rows]
        out.append("")
    return out


# ---- walking argparse ---------------------------------------------------------------------------------


def _subcommands(parser: argparse.ArgumentParser) -> list[tuple[str, argparse.ArgumentParser]]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return list(action.choices.items())
    return []


def _command_help(parser: argparse.ArgumentParser, name: str) -> str:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for choice in action._choices_actions:
                if choice.dest == name:
                    return choice.help or ""
    return ""


def _usage(name: str, sub: argparse.ArgumentParser) -> str:
    """``shardps NAME --required VALUE [options] POSITIONAL``, written here rather than argparse's usage line,
    whose layout changes between Python versions."""
    words = [f"shardps {name}"]
    for action in sub._actions:
        if action.option_strings and action.required:
            words.append(f"{action.option_strings[0]} {str(action.metavar or action.dest).upper()}")
    words.append("[options]")
    for action in sub._actions:
        if not action.option_strings:
            word = str(action.metavar or action.dest).upper()
            words.append({"*": f"[{word} ...]", "+": f"{word} [{word} ...]", "?": f"[{word}]"}.get(
                str(action.nargs), word))
    return " ".join(words)


def _option(action: argparse.Action) -> str:
    if not action.option_strings:
        return f"`{action.metavar or action.dest}` (positional)"
    return ", ".join(f"`{s}`" for s in action.option_strings)


def _value(action: argparse.Action) -> str:
    if action.nargs == 0:
        return "switch"
    if action.choices is not None:
        kind = "one of " + ", ".join(f"`{c}`" for c in action.choices)
    else:
        kind = _type_name(action.type or str)
    if action.nargs == "?":
        return f"{kind}, optional (given alone: `{action.const}`)"
    if action.nargs == "*":
        return f"any number of {kind}"
    if action.nargs == "+":
        return f"one or more of {kind}"
    return kind


def _action_default(action: argparse.Action) -> str:
    if action.required and action.nargs not in ("*", "?"):
        return "required"
    if action.nargs == 0:
        return "off" if not action.default else "on"
    if action.default is None or action.default == []:
        return "none"
    return _default(action.default)


def _meaning(action: argparse.Action) -> tuple[str, Optional[str]]:
    """The option's help without its ``[env X]`` note, and X."""
    help_ = action.help or ""
    if "%(" in help_:
        with contextlib.suppress(KeyError, TypeError, ValueError):
            help_ = help_ % {**vars(action), "prog": ""}
    env = None
    found = _ENV_IN_HELP.search(help_)
    if found:
        env, help_ = found.group(1), _ENV_IN_HELP.sub("", help_)
    if not help_ and action.option_strings:
        flag = action.option_strings[-1].lstrip("-")
        if flag in _SERVE_HELP:
            help_ = f"as `shardps serve --{flag}`: {_SERVE_HELP[flag]}"
    return _text(help_), env


@contextlib.contextmanager
def _without_shardps_environment() -> Iterator[None]:
    """Build the parser as on a machine with no SHARDPS_* set, so the page does not depend on the shell."""
    saved = {k: v for k, v in os.environ.items() if k.startswith("SHARDPS_")}
    for k in saved:
        del os.environ[k]
    try:
        yield
    finally:
        os.environ.update(saved)


# ---- Markdown ------------------------------------------------------------------------------------------


def _row(*cells: str) -> str:
    return "| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |"


def _text(s: str) -> str:
    """Help text as Markdown text: angle brackets would be read as HTML tags."""
    return " ".join(s.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;").split())


def _type_name(cast: object) -> str:
    return getattr(cast, "__name__", str(cast))


def _default(value: object) -> str:
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, float):
        return f"`{value:g}`"
    if isinstance(value, (list, tuple)):
        return " ".join(f"`{v}`" for v in value)
    return f"`{value}`"


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m shardps.server.ops.reference",
                                description="Render docs/configuration.md from the shardps command line.")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--write", nargs="?", const=DEFAULT_PATH, metavar="PATH",
                      help=f"write the page to PATH (default {DEFAULT_PATH}) instead of standard output")
    mode.add_argument("--check", nargs="?", const=DEFAULT_PATH, metavar="PATH",
                      help="exit with code 1 when PATH differs from what would be written")
    args = p.parse_args(argv)
    text = configuration_markdown()
    if args.check:
        try:
            with open(args.check, encoding="utf-8") as f:
                current = f.read()
        except FileNotFoundError:
            current = None
        if current != text:
            print(f"{args.check} is stale: run `make docs`", file=sys.stderr)
            return 1
        return 0
    if args.write:
        with open(args.write, "w", encoding="utf-8") as f:
            f.write(text)
        return 0
    sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
