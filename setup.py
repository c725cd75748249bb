"""The optional C part of the build: kvtop/sim/_blockpool.c, the simulated engine's per-block
loops, and router/_index_loops.c, the router prefix index's. Everything else is in
pyproject.toml. ``optional=True``: where they do not compile (no C compiler or Python headers)
the install goes on without them, and kvtop/sim/_pool.py and router/prefix_index.py run the
same loops in Python."""

from setuptools import Extension, setup

setup(ext_modules=[
    Extension("kvtop.sim._blockpool", ["kvtop/sim/_blockpool.c"], optional=True),
    Extension("router._index_loops", ["router/_index_loops.c"], optional=True),
])
