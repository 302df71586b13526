"""`python -m sublet.compat`: install a drop-in under the name code imports it by.

    python -m sublet.compat install torch_memory_saver [--target DIR] [--force]
    python -m sublet.compat uninstall torch_memory_saver [--target DIR]
    python -m sublet.compat check torch_memory_saver [--target DIR]
    python -m sublet.compat install vllm [--target DIR]
    python -m sublet.compat uninstall vllm [--target DIR]
    python -m sublet.compat list

install torch_memory_saver (_install_tms.py) writes a distribution named torch_memory_saver
that pip sees (version 0.0.10+sublet.VERSION, meeting SGLang's requirement), whose
torch_memory_saver/__init__.py makes `import torch_memory_saver` give sublet's drop-in, its
submodules too; `pip uninstall torch_memory_saver` or uninstall here removes it. Where the
real package is installed it refuses, saying what to do; --force uninstalls the real one with
pip first. check says what holds the name (exit 1 if not sublet's drop-in).

install vllm replaces no package: it installs the switch that puts sublet's allocator under
vLLM's own sleep mode (vllm_switch.py), refusing a vLLM sublet was not tested with.
"""

from __future__ import annotations

import argparse
import sys
import sysconfig
from pathlib import Path

from . import DROP_INS, _install_tms
from ._install_tms import MARKER  # noqa: F401 (the shim's marker, for tests and tools)


def install(name: str, target: Path, force: bool = False) -> str:
    _drop_in(name)
    return _install_tms.install(target, force)


def uninstall(name: str, target: Path) -> str:
    _drop_in(name)
    return _install_tms.uninstall(target)


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
    for command in ("install", "uninstall", "check"):
        p = sub.add_parser(command)
        p.add_argument("name", help=", ".join(sorted(_NAMES if command != "check"
                                                     else DROP_INS)))
        p.add_argument("--target", type=Path, default=_SITE,
                       help="the directory to install into (default: this Python's "
                            "site-packages)")
        if command == "install":
            p.add_argument("--force", action="store_true",
                           help="uninstall a real package of that name first (with pip)")
    sub.add_parser("list")
    args = parser.parse_args(argv)
    if args.command == "list":
        return _list()
    if args.command == "check":
        _drop_in(args.name)
        ok, line = _install_tms.check(args.target)
        print(line)
        return 0 if ok else 1
    try:
        print(_run(args.command, args.name, args.target, getattr(args, "force", False)))
    except OSError as exc:
        raise SystemExit(f"{exc}: choose a directory you can write with --target DIR") from exc
    return 0


_SITE = Path(sysconfig.get_path("purelib"))


def _list() -> int:
    for name, module in sorted(DROP_INS.items()):
        print(f"{name}: {module} ({_install_tms.check(_SITE)[1].split(': ', 1)[1]})")
    print("vllm: sublet.compat.vllm (the switch: vLLM's own sleep mode on sublet)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
