"""Tests of the wire protocol (pie_runtime/protocol/): golden round trips and typed refusals, no engine."""
