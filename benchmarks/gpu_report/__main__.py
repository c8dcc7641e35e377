"""python -m benchmarks.gpu_report: the package's docstring says what it runs."""

import sys

from benchmarks.gpu_report.runner import main

sys.exit(main())
