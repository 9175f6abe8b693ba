"""Print a Compose file for N shards (same layout as docker/compose.yaml).

Usage: python docker/make_compose.py --shards 8 > docker/compose.8.yaml
"""

from __future__ import annotations

import argparse
import pathlib
import re
import sys

TEMPLATE = pathlib.Path(__file__).with_name("compose.yaml")


def make(shards: int) -> str:
    text = TEMPLATE.read_text()
    block = re.search(r"  shard-0:\n(?:    .*\n|      .*\n)+", text)
    assert block is not None
    one = block.group(0)
    blocks = "".join(
        one.replace("shard-0", f"shard-{i}").replace('SHARDPS_SHARD_INDEX: "0"', f'SHARDPS_SHARD_INDEX: "{i}"')
        for i in range(shards)
    )
    start = text.index("  shard-0:\n")
    end = text.index("  trainer:\n")
    text = text[:start] + blocks + text[end:]
    text = re.sub(r'SHARDPS_NUM_SHARDS: "\d+"', f'SHARDPS_NUM_SHARDS: "{shards}"', text)
    text = re.sub(r"--addresses\", \"[^\"]+\"", "--addresses\", \"" + ",".join(f"shard-{i}:7000" for i in range(shards)) + "\"", text)
    deps = "".join(f"      shard-{i}: {{condition: service_healthy}}\n" for i in range(shards))
    text = re.sub(r"    depends_on:\n(?:      shard-\d+: .*\n)+", "    depends_on:\n" + deps, text)
    vols = "".join(f"  shard-{i}-data:\n" for i in range(shards))
    text = re.sub(r"volumes:\n(?:  shard-\d+-data:\n)+$", "volumes:\n" + vols, text)
    return text.replace("A 4-shard", f"A {shards}-shard")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shards", type=int, required=True)
    sys.stdout.write(make(p.parse_args().shards))
    return 0


if __name__ == "__main__":
    sys.exit(main())
