"""Tests of the models (pie_runtime/models/): layers, formats, kernels and parity with transformers."""
