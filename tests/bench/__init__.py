"""Tests of the benchmarks' parts (pie_runtime/bench/): the report, the runs, the workers."""
