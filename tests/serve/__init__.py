"""Tests of `pie serve`: the host pool (test_host_pool.py) and the HTTP API."""
