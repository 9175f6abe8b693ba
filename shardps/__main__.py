import sys

from shardps.server.cli import main

sys.exit(main())
