"""Tests of `pie serve`: the host pool (test_hosts.py) and the HTTP API."""
