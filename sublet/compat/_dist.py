"""Distributions that pip sees, written and removed without pip: a .dist-info beside the files
(METADATA, INSTALLER, RECORD listing every file with its sha256 and size, itself included), so
that `pip list` shows it, `importlib.metadata.version()` answers, and `pip uninstall` removes
exactly those files. remove() follows pip's own rule (every RECORD file, the .pyc of its .py
files, then the directories left empty), for directories pip does not manage (--target).
"""

from __future__ import annotations

import base64
import hashlib
import re
import shutil
from pathlib import Path

INSTALLER = "sublet"


def normalize(name: str) -> str:
    """PEP 503's name: runs of -_. are one -, lower case."""
    return re.sub(r"[-_.]+", "-", name).lower()


def dist_info_name(name: str, version: str) -> str:
    return f"{re.sub(r'[-_.]+', '_', name)}-{version}.dist-info"


def found(target: Path, name: str) -> list[Path]:
    """The .dist-info directories of distribution `name` in target."""
    wanted = normalize(name)
    return sorted(p for p in target.glob("*.dist-info")
                  if p.is_dir() and normalize(p.name[:-len(".dist-info")].split("-")[0]) == wanted)


def field(dist_info: Path, key: str) -> str | None:
    """A field of METADATA (Name, Version, ...), or None."""
    try:
        text = (dist_info / "METADATA").read_text(errors="replace")
    except OSError:
        return None
    match = re.search(rf"^{re.escape(key)}:\s*(.*)$", text, re.M)
    return match.group(1).strip() if match else None


def installer(dist_info: Path) -> str | None:
    try:
        return (dist_info / "INSTALLER").read_text().strip()
    except OSError:
        return None


def write(target: Path, name: str, version: str, files: dict[str, str],
          metadata: dict[str, str]) -> Path:
    """Writes files (paths relative to target -> text) and their .dist-info; returns it."""
    dist_info = target / dist_info_name(name, version)
    meta = {"Metadata-Version": "2.1", "Name": name, "Version": version, **metadata}
    every = {**files,
             f"{dist_info.name}/METADATA": "".join(f"{k}: {v}\n" for k, v in meta.items()),
             f"{dist_info.name}/INSTALLER": INSTALLER + "\n",
             f"{dist_info.name}/top_level.txt": "".join(
                 sorted({p.split("/")[0] + "\n" for p in files}))}
    rows = []
    for relative, text in every.items():
        path = target / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        data = text.encode()
        path.write_bytes(data)
        rows.append(f"{relative},sha256={_digest(data)},{len(data)}")
    rows.append(f"{dist_info.name}/RECORD,,")
    (dist_info / "RECORD").write_text("\n".join(rows) + "\n")
    return dist_info


def _digest(data: bytes) -> str:
    return base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def record(dist_info: Path) -> list[Path]:
    """The files RECORD lists, as paths under the directory that holds dist_info."""
    root = dist_info.parent
    lines = (dist_info / "RECORD").read_text().splitlines()
    return [root / line.rsplit(",", 2)[0] for line in lines if line.strip()]


def remove(dist_info: Path) -> list[Path]:
    """Removes what RECORD lists (and the .pyc of its .py files), then the directories left
    empty, as pip uninstall does; returns the files removed."""
    root = dist_info.parent.resolve()
    files = [p for p in record(dist_info) if root in p.resolve().parents]
    removed = []
    for path in files:
        for each in (path, *_compiled(path)):
            if each.is_file() or each.is_symlink():
                each.unlink()
                removed.append(each)
    for directory in sorted({p.parent for p in files}, key=lambda p: -len(p.parts)):
        _prune(directory, root)
    if dist_info.is_dir():
        shutil.rmtree(dist_info)
    return removed


def _compiled(path: Path) -> list[Path]:
    if path.suffix != ".py":
        return []
    return list((path.parent / "__pycache__").glob(f"{path.stem}.*.pyc"))


def _prune(directory: Path, root: Path) -> None:
    """Removes directory and its parents up to root while they are empty (or hold only an
    empty __pycache__)."""
    while directory != root and root in directory.parents and directory.is_dir():
        cache = directory / "__pycache__"
        if cache.is_dir() and not any(cache.iterdir()):
            cache.rmdir()
        if any(directory.iterdir()):
            return
        directory.rmdir()
        directory = directory.parent
