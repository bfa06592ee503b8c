"""Epilogue programs in the engine: validation on registration, and the torch interpreter that runs them
right after a fire's forward. The engine runs only this closed op set, never inferlet code."""

from .interp import Intrinsics, run_program
from .validate import Program, validate

__all__ = ["Intrinsics", "Program", "run_program", "validate"]
