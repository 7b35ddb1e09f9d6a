"""``sweep-data [list|fetch] [NAME...] [--data-dir DIR]`` (or ``python -m sweep.data``).

``list`` (the default) shows each registered public trace: its origin,
license, size and whether a verified copy is local or cached. ``fetch``
downloads the named traces (all when none is named) into the cache and
verifies them, e.g. before going offline. An unknown name, a copy with other
bytes or a failed download: one line on stderr, exit code 2.
"""

from __future__ import annotations

import argparse
import sys

from sweep.data.registry import (
    CACHE_ENV,
    DATA_DIR_ENV,
    REGISTRY,
    cache,
    fetch,
    local_folder,
    lookup,
    status,
)
from sweep.errors import ConfigError

COMMAND = "sweep-data"


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, not argparse's usage block
        print(f"{COMMAND}: error: {message} (see {COMMAND} --help)", file=sys.stderr)
        sys.exit(2)


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog=COMMAND, description="The public traces the workloads use: "
                "list them, or fetch and verify them before going offline.")
    p.add_argument("command", nargs="?", choices=("list", "fetch"), default="list")
    p.add_argument("names", nargs="*", metavar="NAME",
                   help="registered file names (default: all)")
    p.add_argument("--data-dir", default=None, metavar="DIR",
                   help=f"folder of local copies (default: ${DATA_DIR_ENV})")
    return p


def _list(names: list[str], data_dir: str | None) -> None:
    """Two lines and a citation per trace, readable in 80 columns."""
    for name in names:
        t = REGISTRY[name]
        state, path = status(name, data_dir)
        if path is not None and "differs" not in state:
            state += ", verified"
        print(f"{name}  {t.size_bytes:,} bytes  {t.license}  {state}"
              + (f": {path}" if path is not None else ""))
        print(f"  from {t.url}")
        print(f"  cite {t.citation}")
    folder = local_folder(data_dir)
    print(f"cache: {cache().abspath} (${CACHE_ENV} moves it); local copies: "
          + (str(folder) if folder else f"none (${DATA_DIR_ENV} or --data-dir)"))


def main(argv: list[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    names = args.names or list(REGISTRY)
    try:
        for name in names:
            lookup(name)
        if args.command == "list":
            _list(names, args.data_dir)
            return
        for name in names:
            print(f"{name}: {fetch(name, args.data_dir)}")
    except ConfigError as e:
        print(f"{COMMAND}: error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
