"""Benchmarks: solverkit against its peers on the same problems in one process.

Run `python -m benchmarks --help`; see `benchmarks/README.md`.
"""
