"""Is a model file still the one this process opened? Its size, inode, device and modification
time, recorded at open and compared on demand (one `stat` per file: microseconds).

GGUF weights are served from a mapping of the file: a file truncated under the server turns the
next read past the new end into a SIGBUS, and a file rewritten in place changes the weights under
it. `ModelFiles.check()` before each step and before each re-form turns either into a
`ModelFileChangedError` naming the file and what changed."""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tandem.loaders.errors import ModelFileChangedError


@dataclass(frozen=True)
class FileIdentity:
    path: Path
    size: int
    inode: int
    device: int
    mtime_ns: int

    @classmethod
    def of(cls, path: str | Path) -> FileIdentity:
        st = os.stat(path)
        return cls(Path(path), st.st_size, st.st_ino, st.st_dev, st.st_mtime_ns)

    def change(self) -> str | None:
        """How the file differs from this record now, or None while it is the same."""
        try:
            now = os.stat(self.path)  # asked before every step: no record built
        except OSError as e:
            return f"it is gone ({e.strerror or e})"
        if (now.st_ino, now.st_dev) != (self.inode, self.device):
            return "it was replaced by another file"
        if now.st_size != self.size:
            cut = "truncated" if now.st_size < self.size else "extended"
            return f"it was {cut} to {now.st_size} bytes (it had {self.size})"
        if now.st_mtime_ns != self.mtime_ns:
            return "it was rewritten in place"
        return None


class ModelFiles:
    """The identities of a model's data files, taken now."""

    def __init__(self, paths: Iterable[str | Path]) -> None:
        self.files = [FileIdentity.of(p) for p in dict.fromkeys(Path(p) for p in paths)]
        self._changed: ModelFileChangedError | None = None

    @classmethod
    def of_source(cls, source: Any) -> ModelFiles:
        return cls(data_files(source))

    def change(self) -> ModelFileChangedError | None:
        """The first file that changed since the record (and every later call says the same:
        a file put back does not make the mapping whole again), or None."""
        if self._changed is None:
            for f in self.files:
                why = f.change()
                if why is not None:
                    self._changed = ModelFileChangedError(
                        f"the model file {f.path} changed since it was opened: {why}"
                    )
                    break
        return self._changed

    def check(self) -> None:
        """Raises `ModelFileChangedError` once a file changed (`change`)."""
        changed = self.change()
        if changed is not None:
            raise changed


def data_files(source: Any) -> list[Path]:
    """The files a model source reads its tensors from: a GGUF model's parts, a safetensors
    directory's shards (a quantized-on-load directory's own)."""
    source = getattr(source, "md", source)  # QuantizedModelDir: the directory it quantizes
    files = getattr(source, "files", None)
    if files is not None:  # GGUFModel
        return [Path(f) for f in files]
    manifest = getattr(source, "manifest", {})
    return sorted({Path(info.file) for info in manifest.values() if hasattr(info, "file")})
