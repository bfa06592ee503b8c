"""Tests of the SDK (sdk/inferlet/) without an engine."""
