"""Tests of the command line (pie_runtime/cli/): pie run, pie bench, their output and their errors."""
