"""The optional C part of the build: kvtop/sim/_blockpool.c, the simulated engine's per-block
loops. Everything else is in pyproject.toml. ``optional=True``: where it does not compile (no C
compiler or Python headers) the install goes on without it and kvtop/sim/_pool.py uses the same
loops in Python."""

from setuptools import Extension, setup

setup(ext_modules=[Extension("kvtop.sim._blockpool", ["kvtop/sim/_blockpool.c"], optional=True)])
