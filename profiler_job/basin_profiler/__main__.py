"""`python -m basin_profiler`: the profiling Job's entrypoint (environment: `basin_profiler.job`)."""

import sys

from basin_profiler.job import main

sys.exit(main())
