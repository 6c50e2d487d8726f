"""Container entrypoint: `python -m basin_operator [OPTIONS]` is `basin operator run [OPTIONS]`."""

import sys

from basin.cli import main

sys.argv = ["basin", "operator", "run", *sys.argv[1:]]
main()
