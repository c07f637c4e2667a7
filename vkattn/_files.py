"""One way to replace a file in vkattn's caches: write a temporary file beside it, then rename,
so a reader (another process) never sees half a file; the temporary file removed where any step
fails. Imports nothing of vkattn's (the driver workarounds use it before anything else)."""
from __future__ import annotations

import os
import tempfile
from pathlib import Path


def replace_file(path: Path, data: bytes) -> bool:
    """``path`` (its folders made) now holds ``data``, readable by all (0644: a cache folder
    shared by several users); False, with nothing left behind, where it could not be written (a
    read-only home, a full disk, a folder in the file's place): the caller goes on without it."""
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        os.fchmod(fd, 0o644)        # (mkstemp's 0600 would lock other users of a shared cache out)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
        return True
    except OSError:
        if tmp is not None:
            try:
                os.unlink(tmp)
            except OSError:
                pass
        return False
