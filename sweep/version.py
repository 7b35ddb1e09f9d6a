"""The installed package's version (``sweep.__version__``, cube provenance)."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("llm-serving-sweep")
except PackageNotFoundError:  # running from a source tree
    __version__ = "0.0.0+unknown"
