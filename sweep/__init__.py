"""Planning toolkit for LLM serving: cost and latency sweeps in JAX.

Public API:
  open_cube: open a result cube written by any entry point.
"""

import sweep.cube.accessor  # noqa: F401  (registers ds.sweep)
from sweep.cube.results import open_cube as open_cube
from sweep.version import __version__ as __version__

__all__ = ["open_cube", "__version__"]
