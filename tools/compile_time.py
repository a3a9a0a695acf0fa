"""Compile time of backend="hot" against Inductor, each compile in a new process: on first use and with
HOT's kernels already in Inductor's cache (see hot_compile/compile_bench.py).

    python tools/compile_time.py --model vit --out benchmarks/compile-time --benchmarks-md BENCHMARKS.md
"""

import sys

from hot_compile.harness.compile_bench import main

if __name__ == "__main__":
    sys.exit(main())
