"""Tests of the model store (pie_runtime/store.py) through `pie model ...`."""
