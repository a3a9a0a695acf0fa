"""The evidence around the library, never imported by it: the speed benchmark (``bench``), compile
time (``compile_bench``), ``hot-compile demo`` and the training tasks (``tasks``). The cache key of
the HOT pass does not cover these files."""
