"""Side-by-side speed and memory benchmark of backend="hot" against Inductor (see hot_compile/bench.py).

    python tools/bench.py --out bench_out --benchmarks-md BENCHMARKS.md    # full size, all models
    python tools/bench.py --tiny --models mlp                             # a smoke run in seconds
"""

import sys

from hot_compile.harness.bench import main

if __name__ == "__main__":
    sys.exit(main())
