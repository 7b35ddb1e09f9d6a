"""Planning toolkit for LLM serving: cost and latency sweeps in JAX.

Public API:
  open_cube: open a result cube written by any entry point.
"""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("llm-serving-sweep")
except PackageNotFoundError:  # running from a source tree
    __version__ = "0.0.0+unknown"

import sweep.accessor  # noqa: E402,F401  (registers ds.sweep)
from sweep.results import open_cube as open_cube  # noqa: E402

__all__ = ["open_cube", "__version__"]
