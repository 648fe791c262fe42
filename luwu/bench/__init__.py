"""Benchmarks behind `luwu bench ...`: each prints a ratio against the baseline a user would pick instead, measured in the same run."""
