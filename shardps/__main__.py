import sys

from shardps.server.ops.cli import main

sys.exit(main())
