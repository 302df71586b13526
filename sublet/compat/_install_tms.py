"""`python -m sublet.compat install|uninstall|check torch_memory_saver`: sublet's drop-in under
the name torch_memory_saver, as a distribution pip sees.

install writes site-packages/torch_memory_saver/__init__.py, which makes `import
torch_memory_saver` (and its submodules) give sublet.compat.torch_memory_saver, and the
.dist-info of distribution torch_memory_saver version VERSION (0.0.10+sublet.<sublet's
version>): it meets SGLang's `torch_memory_saver>=0.0.9.post1` (a local version label counts as
its release), and `pip uninstall torch_memory_saver` removes exactly those files. Where the
real torch_memory_saver is installed, install refuses, saying what to do; --force uninstalls it
with pip itself (`python -m pip uninstall -y torch_memory_saver`) first, so that pip and
sublet.compat never disagree. In a --target directory, which no pip manages, both uninstall
by the RECORD, as pip would.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import sysconfig
from pathlib import Path
from typing import NamedTuple, Optional

from . import _dist

NAME = "torch_memory_saver"
RELEASE = "0.0.10"   # the release of torch_memory_saver whose API the drop-in has
MODULE = "sublet.compat.torch_memory_saver"
MARKER = "# sublet-compat-shim:"
SHIM = f'''\
# Installed by `python -m sublet.compat install {NAME}`: sublet's drop-in stands in for
# {NAME} (`pip uninstall {NAME}` or `python -m sublet.compat uninstall {NAME}` removes it).
{MARKER} {MODULE}
import {MODULE} as _package

_package.alias_as(__name__)
'''


def version() -> str:
    """The distribution's version: the release it stands in for, labelled sublet's."""
    return f"{RELEASE}+sublet.{_sublet_version()}"


def _sublet_version() -> str:
    try:
        import sublet
        return str(sublet.__version__)
    except Exception:  # noqa: BLE001 (no libsublet here: the package's metadata says it)
        import importlib.metadata
        return importlib.metadata.version("sublet")


class State(NamedTuple):
    """What holds the name torch_memory_saver in a directory."""
    ours: Optional[Path]      # sublet's .dist-info
    real: Optional[Path]      # another torch_memory_saver distribution's .dist-info
    unregistered: Optional[Path]  # a torch_memory_saver package or module of no distribution
    overwritten: bool         # ours is registered, but its __init__.py is not the shim


def state(target: Path) -> State:
    ours = real = None
    for dist_info in _dist.found(target, NAME):
        if _is_ours(dist_info):
            ours = dist_info
        else:
            real = dist_info
    package, module = target / NAME, target / f"{NAME}.py"
    shim = _is_shim(package)
    unregistered = None
    if ours is None and real is None and (package.exists() or module.exists()):
        unregistered = package if package.exists() else module
    return State(ours, real, unregistered, ours is not None and not shim)


def _is_ours(dist_info: Path) -> bool:
    return _dist.installer(dist_info) == _dist.INSTALLER and \
        "+sublet" in (_dist.field(dist_info, "Version") or "")


def _is_shim(package: Path) -> bool:
    init = package / "__init__.py"
    return init.is_file() and MARKER in init.read_text(errors="replace")


def install(target: Path, force: bool = False) -> str:
    found = state(target)
    if found.unregistered is not None and not _is_shim(target / NAME):
        raise SystemExit(f"{found.unregistered} is a {NAME} no distribution owns (no "
                         f".dist-info): remove it, then install again")
    if (found.real is not None or found.overwritten) and not force:
        raise SystemExit(_refusal(target, found))
    replaced = _clear(target, found)
    # No Requires-Dist: sublet: where sublet is no distribution pip sees (a checkout on
    # PYTHONPATH, a --target install), pip would take it as unmet and replace the drop-in
    # with the real package at the next `pip install torch_memory_saver`.
    dist_info = _dist.write(target, NAME, version(), {f"{NAME}/__init__.py": SHIM}, {
        "Summary": f"sublet's drop-in for {NAME} {RELEASE} (python -m sublet.compat)"})
    return (f"installed {target / NAME} ({dist_info.name}){replaced}: `import {NAME}` gives "
            f"{MODULE}; pip sees {NAME} {version()}; undo with `pip uninstall {NAME}` or "
            f"`python -m sublet.compat uninstall {NAME}`")


def _refusal(target: Path, found: State) -> str:
    if found.overwritten:
        what = (f"sublet's {NAME} in {target} was written over by another install (pip "
                f"--target or --ignore-installed): its files are not sublet's")
    elif found.real is not None:
        what = f"the real {NAME} {_dist.field(found.real, 'Version')} is installed in {target}"
    else:
        what = f"a {NAME} not sublet's is installed in {target}"
    return (f"{what}: uninstall it first (`{sys.executable} -m pip uninstall {NAME}`), or "
            f"pass --force, which does that with pip itself. sublet's drop-in, version "
            f"{version()}, meets any {NAME}>=0.0.9.post1 requirement (SGLang's)")


def _clear(target: Path, found: State) -> str:
    """Removes ours (a reinstall) and then the real one, with pip where pip manages target."""
    gone = ""
    if found.ours is not None:
        _dist.remove(found.ours)
    real = state(target).real
    if real is not None:
        gone = f"; the real {NAME} {_dist.field(real, 'Version')} uninstalled"
        _uninstall_real(target, real)
    return gone


def _uninstall_real(target: Path, real: Path) -> None:
    if not _pip_manages(target):
        _dist.remove(real)
        return
    command = [sys.executable, "-m", "pip", "uninstall", "-y", NAME]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0 or state(target).real is not None:
        raise SystemExit(f"`{' '.join(command)}` did not uninstall the real {NAME} from "
                         f"{target}:\n{done.stdout}{done.stderr}\nuninstall it by hand, then "
                         f"install again")


def _pip_manages(target: Path) -> bool:
    """Is target this Python's site-packages (where `python -m pip` uninstalls)?"""
    paths = {sysconfig.get_path("purelib"), sysconfig.get_path("platlib")}
    return target.resolve() in {Path(p).resolve() for p in paths if p}


def uninstall(target: Path) -> str:
    found = state(target)
    if found.ours is None:
        if found.real is not None:
            raise SystemExit(f"the {NAME} in {target} is the real one "
                             f"({_dist.field(found.real, 'Version')}), not sublet's: "
                             f"uninstall it with `pip uninstall {NAME}`")
        raise SystemExit(f"no sublet {NAME} in {target}: nothing to uninstall")
    if found.overwritten:
        raise SystemExit(f"sublet's {NAME} in {target} was written over by another install: "
                         f"`pip uninstall {NAME}` both, then install the one you want")
    removed = _dist.remove(found.ours)
    return f"removed sublet's {NAME} from {target} ({len(removed)} files)"


def check(target: Path) -> tuple[bool, str]:
    """Is sublet's drop-in what holds the name in target (and what `import` finds here)?"""
    found = state(target)
    if found.overwritten or (found.ours is not None and found.real is not None):
        return False, (f"{NAME}: sublet's drop-in in {target} was written over by another "
                       f"install (`pip install {NAME}` with --target or --ignore-installed): "
                       f"`python -m sublet.compat install {NAME} --force` puts it back")
    if found.real is not None:
        return False, (f"{NAME}: the real {NAME} {_dist.field(found.real, 'Version')} is "
                       f"installed in {target}, not sublet's (pip installed it, or a "
                       f"requirement pinned it): `python -m sublet.compat install {NAME} "
                       f"--force` replaces it")
    if found.ours is None:
        return False, (f"{NAME}: not installed in {target}: `python -m sublet.compat install "
                       f"{NAME}`")
    return True, (f"{NAME}: sublet's drop-in {_dist.field(found.ours, 'Version')} in "
                  f"{target}{_shadowed(target)}")


def _shadowed(target: Path) -> str:
    """Where `import torch_memory_saver` finds another one first in this Python, say so."""
    spec = importlib.util.find_spec(NAME) if NAME not in sys.modules else None
    origin = Path(spec.origin).resolve() if spec is not None and spec.origin else None
    if origin is None or origin == (target / NAME / "__init__.py").resolve():
        return ""
    return f" (but `import {NAME}` here finds {origin} first)"
