"""Public request traces: a registry of pinned, hashed origins, fetched on first
use and cached (``sweep.data.registry``); ``sweep-data`` lists and pre-fetches.

Public API:
  REGISTRY: registered name -> ``PublicTrace`` (origin, sha256, license, citation).
  fetch: a verified local path of a registered trace.
  status: where a verified copy is, without downloading.
  DataError: the one-line error of a trace that cannot be had or does not verify.
"""

from sweep.data.registry import (
    CACHE_ENV,
    DATA_DIR_ENV,
    REGISTRY,
    DataError,
    PublicTrace,
    fetch,
    status,
)

__all__ = ["CACHE_ENV", "DATA_DIR_ENV", "REGISTRY", "DataError", "PublicTrace",
           "fetch", "status"]
