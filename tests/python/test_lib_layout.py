"""The ctypes structures of sublet/_lib.py against include/sublet.h, as the system's C compiler
lays the structs out: the size of each struct, and the offset and size of every field that
ctypes declares. A field added, removed, reordered or retyped on one side only would make the
library write past a Python buffer or read stats from the wrong bytes, silently.

A small C program, written from the ctypes declarations, prints sizeof and offsetof; a field
ctypes names that C lacks fails its compilation. Skipped without a C compiler (CI has one)."""

from __future__ import annotations

import ctypes
import os
import shlex
import shutil
import subprocess

import pytest

from sublet import _lib

from conftest import REPO

# ctypes structure -> the C struct it mirrors
STRUCTS = {
    "sublet_info": _lib.Info,
    "sublet_loan_stats": _lib.CLoanStats,
    "sublet_release_stats": _lib.CReleaseStats,
    "sublet_leak": _lib.CLeak,
}
# Constants _lib.py copies from the header, by macro name.
CONSTANTS = {"SUBLET_TOKEN_SIZE": _lib.TOKEN_BYTES, "SUBLET_STAY_ANY": _lib.STAY_ANY}


def c_program(structs: dict[str, type[ctypes.Structure]]) -> str:
    """C that prints one line per struct ("NAME sizeof N"), per field ctypes declares
    ("NAME FIELD OFFSET SIZE") and per constant ("MACRO VALUE")."""
    lines = ["#include <stdio.h>", "#include <stddef.h>", '#include "sublet.h"',
             "int main(void) {"]
    for name, struct in structs.items():
        lines.append(f'  printf("{name} sizeof %zu\\n", sizeof(struct {name}));')
        lines += [f'  printf("{name} {field} %zu %zu\\n", offsetof(struct {name}, {field}), '
                  f"sizeof(((struct {name} *)0)->{field}));" for field, *_ in struct._fields_]
    lines += [f'  printf("{macro} %llu\\n", (unsigned long long)({macro}));'
              for macro in CONSTANTS]
    lines += ["  return 0;", "}"]
    return "\n".join(lines) + "\n"


class _Range(ctypes.Structure):
    """struct sublet_range as _lib passes it: a row of an (n, 2) uint64 array."""
    _fields_ = [("offset", ctypes.c_uint64), ("length", ctypes.c_uint64)]


def c_layout(tmp_path, structs: dict[str, type[ctypes.Structure]]) -> dict:
    cc, *flags = shlex.split(os.environ.get("CC") or "cc")
    if shutil.which(cc) is None:
        pytest.skip(f"no C compiler ({cc}) to lay out include/sublet.h's structs: install "
                    f"build-essential (CI has it)")
    source, binary = tmp_path / "layout.c", tmp_path / "layout"
    source.write_text(c_program(structs))
    built = subprocess.run([cc, *flags, "-std=c11", "-I", str(REPO / "include"), "-o", str(binary),
                            str(source)], capture_output=True, text=True, timeout=120)
    assert built.returncode == 0, (
        f"the ctypes fields do not compile against include/sublet.h (a field ctypes names "
        f"that the header lacks?):\n{built.stderr}")
    out = subprocess.run([str(binary)], capture_output=True, text=True, check=True, timeout=60)
    return parse_layout(out.stdout)


def parse_layout(text: str) -> dict:
    """{struct: {"sizeof": n, "fields": {field: [offset, size]}}, macro: value}."""
    layout: dict = {}
    for words in (line.split() for line in text.splitlines()):
        if len(words) == 2:
            layout[words[0]] = int(words[1])
        elif words[1] == "sizeof":
            layout.setdefault(words[0], {"fields": {}})["sizeof"] = int(words[2])
        else:
            layout[words[0]]["fields"][words[1]] = [int(words[2]), int(words[3])]
    return layout


def python_layout(struct: type[ctypes.Structure]) -> dict:
    return {"sizeof": ctypes.sizeof(struct),
            "fields": {name: [getattr(struct, name).offset, getattr(struct, name).size]
                       for name, *_ in struct._fields_}}


ALL = {**STRUCTS, "sublet_range": _Range}


def test_ctypes_structures_match_the_header(tmp_path):
    layout = c_layout(tmp_path, ALL)
    for name, struct in ALL.items():
        assert python_layout(struct) == layout[name], (
            f"struct {name} (C) and {struct.__name__} (ctypes, sublet/_lib.py) differ: change "
            f"_lib.py to the header's fields, in its order and with its types")
    assert {m: layout[m] for m in CONSTANTS} == CONSTANTS


def _short() -> list:
    return _lib.CLoanStats._fields_[:-1]  # C grew a field and _lib.py was not told


def _retyped() -> list:
    return [(n, ctypes.c_uint64 if n == "borrower_died" else t)
            for n, t in _lib.CLoanStats._fields_]  # an int read as 8 bytes


@pytest.mark.parametrize("fields", [_short, _retyped], ids=["field-missing", "field-retyped"])
def test_a_ctypes_structure_that_differs_is_caught(tmp_path, fields):
    # The check is not vacuous: a CLoanStats wrong in either way differs from the header's.
    wrong = type("WrongLoanStats", (ctypes.Structure,), {"_fields_": fields()})
    layout = c_layout(tmp_path, {"sublet_loan_stats": wrong})
    assert python_layout(wrong) != layout["sublet_loan_stats"]
