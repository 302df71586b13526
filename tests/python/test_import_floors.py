"""The package's modules on floors: each imports only modules on floors below its own, so that
the import graph has no circle and no module reaches up (as _pool once did into _loan).

Read from the source with ast, every import counted (at module level, in a function, under
TYPE_CHECKING), nothing imported. A module on no floor fails too: place a new one where what it
imports puts it. An import that fails here is either a call up (turn it into a callback, or
move the shared piece one floor down) or a module on too low a floor (raise it, if nothing
below it then imports it). sublet.compat sits above the whole package: nothing here imports it.
"""

from __future__ import annotations

import ast

from conftest import REPO

PACKAGE = REPO / "sublet"

# Lowest first. "__init__" is the package itself (`from . import __version__` reads it).
FLOORS = [
    {"_units", "_errors", "_torch"},  # nothing of sublet
    {"_lib"},                         # the ctypes binding
    {"_daemon", "_keep", "_subletd"},
    {"_client"},
    {"_memory", "_wait"},
    {"_pool", "_take", "_verify"},
    {"_lent"},
    {"_loan", "_release"},
    {"__init__"},
    {"_status"},                      # the CLI
    {"__main__"},
]
FLOOR = {name: level for level, names in enumerate(FLOORS) for name in names}


def imported(module: str) -> set[str]:
    """The modules of sublet that sublet/<module>.py imports ("compat" for sublet.compat)."""
    tree = ast.parse((PACKAGE / f"{module}.py").read_text())
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            parts = [a.name.split(".") for a in node.names if a.name.split(".")[0] == "sublet"]
            found |= {p[1] if len(p) > 1 else "__init__" for p in parts}
        elif isinstance(node, ast.ImportFrom) and (node.level == 1 or (
                node.level == 0 and (node.module or "").split(".")[0] == "sublet")):
            path = (node.module or "").split(".")[1 if node.level == 0 else 0:]
            if path and path[0]:
                found.add(path[0])
            else:  # from . import _keep, __version__
                found |= {a.name if (PACKAGE / f"{a.name}.py").exists() else "__init__"
                          for a in node.names}
    found.discard(module)
    return found


def test_every_module_is_on_a_floor():
    modules = {p.stem for p in PACKAGE.glob("*.py")}
    assert modules - set(FLOOR) == set(), "place these modules on a floor of FLOORS"
    assert set(FLOOR) - modules == set(), "modules gone: take them off FLOORS"


def test_imports_go_downwards_only():
    upward = [f"{m} (floor {FLOOR[m]}) imports {d} (floor {FLOOR.get(d, 'none')})"
              for m in sorted(FLOOR) for d in sorted(imported(m))
              if d == "compat" or FLOOR.get(d, len(FLOORS)) >= FLOOR[m]]
    assert not upward, "\n".join(upward)


def test_the_check_sees_an_import_reaching_up(tmp_path, monkeypatch):
    # The check itself: a function-level import of a higher module, as _pool's of _loan was.
    (tmp_path / "_pool.py").write_text("def f():\n    from ._loan import _active\n")
    monkeypatch.setitem(globals(), "PACKAGE", tmp_path)
    assert imported("_pool") == {"_loan"}
    assert FLOOR["_loan"] > FLOOR["_pool"]
