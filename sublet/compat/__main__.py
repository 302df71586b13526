"""`python -m sublet.compat`: install a drop-in under the name code imports it by.

    python -m sublet.compat install torch_memory_saver [--target DIR] [--force]
    python -m sublet.compat uninstall torch_memory_saver [--target DIR]
    python -m sublet.compat install vllm [--target DIR]
    python -m sublet.compat uninstall vllm [--target DIR]
    python -m sublet.compat list

install writes a package of one small __init__.py into site-packages (or DIR) that replaces
itself, in sys.modules, with sublet's module (sublet.compat.DROP_INS), so that
`import torch_memory_saver` gives sublet's drop-in, its submodules too. It refuses when the
real package is installed there; --force moves the real one aside (to NAME.sublet-saved),
and uninstall puts it back.

install vllm replaces no package: it installs the switch that puts sublet's allocator under
vLLM's own sleep mode (vllm_switch.py), refusing a vLLM sublet was not tested with.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import sysconfig
from pathlib import Path

from . import DROP_INS

MARKER = "# sublet-compat-shim:"
SAVED_SUFFIX = ".sublet-saved"

SHIM = '''\
# Installed by `python -m sublet.compat install {name}`: sublet's drop-in stands in for
# {name} (`python -m sublet.compat uninstall {name}` removes it).
{marker} {module}
import importlib as _importlib
import sys as _sys

_module = _importlib.import_module("{module}")
for _name in getattr(_module, "__submodules__", ()):
    _sys.modules[__name__ + "." + _name] = getattr(_module, _name)
_sys.modules[__name__] = _module
'''


def is_shim(package: Path) -> bool:
    init = package / "__init__.py"
    return init.is_file() and MARKER in init.read_text(errors="replace")


def real_package(target: Path, name: str) -> Path | None:
    """The real package (or module) of that name in target, if one is there."""
    package, module = target / name, target / f"{name}.py"
    if package.exists() and not is_shim(package):
        return package
    return module if module.exists() else None


def install(name: str, target: Path, force: bool = False) -> str:
    module = _drop_in(name)
    real = real_package(target, name)
    if real is not None:
        if not force:
            raise SystemExit(f"the real {name} is installed at {real}: uninstall it first "
                             f"(pip uninstall {name}), or pass --force to move it aside to "
                             f"{real.name}{SAVED_SUFFIX} (uninstall puts it back)")
        saved = target / (real.name + SAVED_SUFFIX)
        if saved.exists():
            raise SystemExit(f"{saved} exists already: remove it or move it back first")
        real.rename(saved)
    package = target / name
    package.mkdir(parents=True, exist_ok=True)
    (package / "__init__.py").write_text(SHIM.format(name=name, module=module, marker=MARKER))
    return f"installed {package}: `import {name}` gives {module}"


def uninstall(name: str, target: Path) -> str:
    _drop_in(name)
    package = target / name
    if not is_shim(package):
        raise SystemExit(f"no sublet shim of {name} in {target}: nothing to uninstall")
    shutil.rmtree(package)
    restored = ""
    for saved in (target / (name + SAVED_SUFFIX), target / (f"{name}.py" + SAVED_SUFFIX)):
        if saved.exists():
            saved.rename(target / saved.name[:-len(SAVED_SUFFIX)])
            restored = f"; the real {name} is back"
    return f"removed {package}{restored}"


def _drop_in(name: str) -> str:
    if name not in DROP_INS:
        raise SystemExit(f"sublet has no drop-in named {name!r}: one of "
                         f"{', '.join(sorted(_NAMES))}")
    return DROP_INS[name]


_NAMES = (*DROP_INS, "vllm")   # vllm: the switch, not a module (vllm_switch.py)


def _run(command: str, name: str, target: Path, force: bool) -> str:
    if name == "vllm":
        from . import vllm_switch, vllm_versions
        try:
            if command == "install":
                return vllm_switch.install(target)
            return vllm_switch.uninstall(target)
        except vllm_versions.UntestedVLLMError as exc:
            raise SystemExit(str(exc)) from exc
    if command == "install":
        return install(name, target, force)
    return uninstall(name, target)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sublet.compat",
                                     description="Install sublet's drop-ins under the names "
                                                 "code imports them by.")
    sub = parser.add_subparsers(dest="command", required=True)
    for command in ("install", "uninstall"):
        p = sub.add_parser(command)
        p.add_argument("name", help=", ".join(sorted(_NAMES)))
        p.add_argument("--target", type=Path, default=Path(sysconfig.get_path("purelib")),
                       help="the directory to install into (default: this Python's "
                            "site-packages)")
        if command == "install":
            p.add_argument("--force", action="store_true",
                           help="move a real package of that name aside")
    sub.add_parser("list")
    args = parser.parse_args(argv)
    if args.command == "list":
        for name, module in sorted(DROP_INS.items()):
            print(f"{name}: {module}")
        print("vllm: sublet.compat.vllm (the switch: vLLM's own sleep mode on sublet)")
        return 0
    try:
        print(_run(args.command, args.name, args.target, getattr(args, "force", False)))
    except OSError as exc:
        raise SystemExit(f"{exc}: choose a directory you can write with --target DIR") from exc
    return 0


if __name__ == "__main__":
    sys.exit(main())
