"""Benchmarks: ``python -m lowprec bench <op>`` (GPU), each vs the peers a user would pick instead."""
