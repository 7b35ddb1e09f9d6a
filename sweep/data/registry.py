"""The public traces the shipped workloads use: where each comes from, and how
to get a verified copy.

The project carries none of these files. Each is fetched on first use from a
pinned commit of the repository that published it (raw GitHub URL), checked
against its SHA-256 and kept in pooch's cache (``pooch.os_cache``, or the
folder named by ``SWEEP_DATA_CACHE``). A folder of local copies (the
``data_dir`` setting, else ``SWEEP_DATA_DIR``) comes first: a file found
there is verified and used without any download, which is how to work
offline. To add a trace, add a ``PublicTrace`` to ``REGISTRY``.
"""

from __future__ import annotations

import logging
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

import pooch
import requests

from sweep.errors import ConfigError

DATA_DIR_ENV = "SWEEP_DATA_DIR"
CACHE_ENV = "SWEEP_DATA_CACHE"
CACHE_APP = "llm-serving-sweep"
# (connect, read) seconds: an offline machine fails in seconds, not minutes
DOWNLOAD_TIMEOUT_S = (10, 30)

AZURE_CITATION = ('Patel et al., "Splitwise: Efficient generative LLM inference '
                  'using phase splitting", ISCA 2024')


@dataclass(frozen=True)
class PublicTrace:
    """One registered file: its local name, its origin and its expected bytes."""

    name: str
    repository: str  # GitHub owner/name
    path: str  # inside the repository (upstream names differ from ``name``)
    commit: str  # pinned: the bytes at this commit are the ones hashed
    sha256: str
    size_bytes: int
    license: str
    citation: str

    @property
    def url(self) -> str:
        return (f"https://raw.githubusercontent.com/{self.repository}/{self.commit}/"
                f"{self.path}")

    @property
    def origin(self) -> str:
        return f"{self.repository}@{self.commit[:10]}:{self.path}"


REGISTRY: dict[str, PublicTrace] = {t.name: t for t in (
    PublicTrace(
        name="azure_llm_2023_code.csv",
        repository="Azure/AzurePublicDataset",
        path="data/AzureLLMInferenceTrace_code.csv",
        commit="790921015d50dd6aae7f7e47f39ba0e235ad6b08",
        sha256="54e9a6d2a4bd06ba1e060304b900abbc74cbea53de96506e60fe5bb4f2277fb6",
        size_bytes=320_117, license="CC-BY-4.0", citation=AZURE_CITATION),
    PublicTrace(
        name="azure_llm_2023_conv.csv",
        repository="Azure/AzurePublicDataset",
        path="data/AzureLLMInferenceTrace_conv.csv",
        commit="790921015d50dd6aae7f7e47f39ba0e235ad6b08",
        sha256="2f1e5b666d4e3055fdbba98598ce2ec307767b9064e03e2fa46676dbcc7d0bf8",
        size_bytes=719_188, license="CC-BY-4.0", citation=AZURE_CITATION),
    PublicTrace(
        name="sharegpt_8k_lengths_llama2.csv",
        repository="microsoft/sarathi-serve",
        path="data/processed_traces/sharegpt_8k_filtered_stats_llama2_tokenizer.csv",
        commit="72339db5b120614033b317880ad3a05a5e4c9415",
        sha256="6d6c296302a853e2669a674a96f269283e60c57e60363bd450588a1066919f9f",
        size_bytes=949_600, license="Apache-2.0",
        citation="microsoft/sarathi-serve, branch niyama_asplos2026 (the repository "
                 "names no paper to cite)"),
)}


class DataError(ConfigError):
    """A registered trace that cannot be had, or whose bytes are not the
    registered ones; one line."""

    def __init__(self, name: str, reason: str) -> None:
        super().__init__(f"{name}: {reason}")
        self.name = name
        self.reason = reason


def lookup(name: str) -> PublicTrace:
    """The registered trace ``name``; ``DataError`` listing the names if none."""
    try:
        return REGISTRY[name]
    except KeyError:
        raise DataError(name, "not a registered public trace; registered: "
                        + ", ".join(REGISTRY)) from None


def local_folder(data_dir: str | os.PathLike | None = None) -> Path | None:
    """The folder of local copies: ``data_dir``, else ``$SWEEP_DATA_DIR``, else None.

    Raises:
      ConfigError: the setting names something that is not a folder.
    """
    setting, value = "data_dir", data_dir
    if not value:
        setting, value = DATA_DIR_ENV, os.environ.get(DATA_DIR_ENV)
    if not value:
        return None
    folder = Path(value).expanduser()
    if not folder.is_dir():
        raise ConfigError(f"{setting} = {str(value)!r}: not a folder")
    return folder


def cache() -> pooch.Pooch:
    """pooch's view of the download cache (``$SWEEP_DATA_CACHE`` overrides it)."""
    return pooch.create(
        path=pooch.os_cache(CACHE_APP) / "traces",
        base_url="",
        registry={t.name: f"sha256:{t.sha256}" for t in REGISTRY.values()},
        urls={t.name: t.url for t in REGISTRY.values()},
        env=CACHE_ENV,
    )


def sha256_of(path: Path) -> str:
    return pooch.file_hash(str(path), alg="sha256")


def verify(path: Path, trace: PublicTrace) -> Path:
    """``path`` when its bytes hash to the registered SHA-256; else ``DataError``."""
    got = sha256_of(path)
    if got != trace.sha256:
        raise DataError(trace.name, (
            f"the copy {path} has sha256 {got}, not the registered {trace.sha256}; "
            f"replace it with the file from {trace.url}"))
    return path


def _identity(path: Path) -> tuple[int, int] | None:
    try:
        st = path.stat()
    except FileNotFoundError:
        return None
    return st.st_ino, st.st_mtime_ns


def _why(e: Exception, url: str) -> str:
    """A download failure in a few words."""
    if isinstance(e, requests.Timeout):
        return f"timed out after {DOWNLOAD_TIMEOUT_S} s (connect, read)"
    if isinstance(e, requests.ConnectionError):
        return f"no connection to {urlparse(url).hostname}"
    if isinstance(e, requests.HTTPError) and e.response is not None:
        return f"HTTP {e.response.status_code}"
    if isinstance(e, ValueError):  # pooch: the downloaded bytes hash differently
        return "the downloaded bytes do not have the registered sha256"
    return " ".join(str(e).split()) or type(e).__name__


def fetch(name: str, data_dir: str | os.PathLike | None = None) -> Path:
    """A verified copy of the registered trace ``name``.

    The local folder's copy if it has one (verified), else the cache's
    (verified by pooch), else a download into the cache with a progress bar
    (verified before it is moved into place).

    Raises:
      DataError: unknown name, a local copy with other bytes, or a file that
        is neither local, cached nor downloadable; one line naming the file,
        its origin and the settings to use.
      ConfigError: the local-folder setting is not a folder.
    """
    trace = lookup(name)
    folder = local_folder(data_dir)
    if folder is not None and (folder / name).is_file():
        return verify(folder / name, trace)
    pup = cache()
    before = _identity(pup.abspath / name)
    log = pooch.get_logger()
    level = log.level
    log.setLevel(logging.WARNING)  # its "Downloading ..." line; ours follows success
    try:
        path = Path(pup.fetch(name, downloader=pooch.HTTPDownloader(
            progressbar=True, timeout=DOWNLOAD_TIMEOUT_S)))
    except (requests.RequestException, ValueError, OSError) as e:
        # the network, pooch's hash check of the download, or the cache folder
        where = (f"no copy in the data folder {folder}" if folder is not None
                 else f"no data folder set ({DATA_DIR_ENV} or data_dir=)")
        raise DataError(name, (
            f"{where}, no verified copy in the download cache {pup.abspath}, and the "
            f"download from {trace.url} failed ({_why(e, trace.url)}); put the file "
            "in a folder named "
            f"by {DATA_DIR_ENV} or data_dir=, or run 'sweep-data fetch {name}' "
            "where GitHub is reachable")) from None
    finally:
        log.setLevel(level)
    if _identity(path) != before:  # pooch moved a new download into place
        print(f"fetched {name} ({trace.license}) from {trace.origin}, sha256 "
              f"verified, into {path.parent}", file=sys.stderr)
    return path


def status(name: str,
           data_dir: str | os.PathLike | None = None) -> tuple[str, Path | None]:
    """Where a verified copy of ``name`` is, without downloading anything.

    Returns:
      ``(state, path)``: state ``local``, ``cached``, ``local, sha256 differs``
      or ``cached, sha256 differs``, or ``not fetched`` (path None).
    """
    trace = lookup(name)
    folder = local_folder(data_dir)
    candidates = [("local", folder / name)] if folder is not None else []
    candidates.append(("cached", cache().abspath / name))
    for state, path in candidates:
        if path.is_file():
            ok = sha256_of(path) == trace.sha256
            return (state if ok else f"{state}, sha256 differs"), path
    return "not fetched", None
