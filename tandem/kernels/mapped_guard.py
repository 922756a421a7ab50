"""A SIGBUS on a mapped model file turned into a named exit (csrc/sigbus.c), torch-free.

`watch(source)` records the address range of each mapping of `source`'s files (a GGUF model's
parts, mapped whole by its reader) with the native handler: a read of a page past a truncated
file's new end then writes "tandem: SIGBUS reading the mapped model file F at byte B ..." to
stderr and exits with `MAPPED_FILE_EXIT`, which the supervisor names
(`tandem.cluster.exits.exit_cause`). Python's faulthandler is enabled first, so any other
SIGBUS (and a model file's where the native build is unavailable) still prints a traceback
before the process dies. Where a step checks the files' identity first (`ModelFiles`), a
truncated file is refused before it is read; this covers the truncation that lands mid-step."""

from __future__ import annotations

import faulthandler
import os
from typing import Any

from tandem.cluster.exits import MAPPED_FILE_EXIT
from tandem.kernels import library


def mappings(source: Any) -> list[tuple[int, int, str]]:
    """(address, bytes, file) of each whole-file mapping `source` holds (a GGUF model's
    readers'); none for a source that reads by copy (safetensors)."""
    out = []
    for f, reader in zip(getattr(source, "files", ()), getattr(source, "readers", ())):
        data = getattr(reader, "data", None)
        if data is not None and data.nbytes:
            out.append((int(data.ctypes.data), int(data.nbytes), os.fspath(f)))
    return out


def watch(source: Any) -> bool:
    """Names a SIGBUS on any of `source`'s mappings (module docstring); False where the native
    handler is unavailable (faulthandler's traceback stays)."""
    if not faulthandler.is_enabled():
        faulthandler.enable()
    if not library.available():
        return False
    lib = library.library()
    for addr, n, name in mappings(source):
        if lib.tandem_watch_mapping(addr, n, name.encode(errors="replace"), MAPPED_FILE_EXIT):
            return False
    return True
