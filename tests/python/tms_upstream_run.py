"""How torch_memory_saver's own test suite (tests/python/tms_upstream/test/, vendored verbatim)
is run in a child pytest and read back, shared by its two drivers:

- tests/python/test_compat_tms_upstream.py, which checks each upstream test's outcome against
  its table UPSTREAM, with sublet's drop-in installed as torch_memory_saver;
- tests/tms-upstream-gpu, which runs the suite twice on one GPU, against the real
  torch_memory_saver wheel and against the drop-in, and lists the outcomes side by side
  (`table` below).

The child runs in upstream's directory under none of sublet's pytest configuration (an empty
pytest.ini), with the directory the package is installed in first on its path.

As a command (tests/tms-upstream-gpu uses it; tests/python is its sys.path[0]):

    python3 tests/python/tms_upstream_run.py pytest TARGET INI [PYTEST ARGUMENTS]
        runs upstream's pytest with TARGET first on the path (it replaces this process, so
        that a `timeout` in front of it stops pytest itself)
    python3 tests/python/tms_upstream_run.py table TABLE.md NAME=REPORT.xml ...
        writes TABLE.md: one row per upstream test, one outcome column per junit report in
        the order given, then UPSTREAM's column for one GPU; prints its summary lines
"""

from __future__ import annotations

import os
import re
import sys
import xml.etree.ElementTree as ET
from collections.abc import Mapping, Sequence
from pathlib import Path

UPSTREAM_DIR = Path(__file__).resolve().parent / "tms_upstream" / "test"
PASS, FAIL, SKIP = "passed", "failed", "skipped"

# Upstream files not run at all.
NOT_RUN = {"test_merge_cuda_wheels.py": "it tests the original's wheel-merging script "
                                        "(scripts/merge_cuda_wheels.py, not vendored), "
                                        "nothing of the package"}


def pytest_command(ini: Path, args: Sequence[str], python: str = sys.executable) -> list[str]:
    """Upstream's pytest, to run in UPSTREAM_DIR; writes INI, the empty configuration."""
    ini.write_text("[pytest]\n")
    return [python, "-m", "pytest", "-p", "no:cacheprovider", "-c", str(ini),
            "--rootdir", str(UPSTREAM_DIR), "--confcutdir", str(UPSTREAM_DIR),
            *(f"--ignore={name}" for name in NOT_RUN), *args]


def child_env(target: Path, base: Mapping[str, str]) -> dict[str, str]:
    """BASE with TARGET, where torch_memory_saver is installed, first on PYTHONPATH."""
    env = dict(base)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(target), env.get("PYTHONPATH")]))
    return env


def _cases(report: Path):
    """(nodeid, testcase element) of each test in a junit report of upstream's pytest."""
    for case in ET.parse(report).getroot().iter("testcase"):
        yield f"{case.get('classname', '').split('.')[-1]}.py::{case.get('name')}", case


def outcomes(report: Path) -> dict[str, tuple[str, str]]:
    """nodeid -> (outcome, message) of each test in a junit report of upstream's pytest."""
    found = {}
    for nodeid, case in _cases(report):
        outcome, message = PASS, ""
        for tag, name in (("failure", FAIL), ("error", FAIL), ("skipped", SKIP)):
            node = case.find(tag)
            if node is not None:
                outcome = name
                message = (node.get("message") or "") + "\n" + (node.text or "")[-2000:]
                break
        found[nodeid] = (outcome, message)
    return found


def first_line(message: str, width: int = 160) -> str:
    line = next((s.strip() for s in message.splitlines() if s.strip()), "")
    return line if len(line) <= width else line[:width - 1] + "…"


# test_examples.py runs each example in a spawned child and only asserts that it succeeded
# ("assert False"): the child's own error is in the output pytest captured, which the junit
# report holds where the run passed -o junit_logging=all (tests/tms-upstream-gpu does).
_HARNESS = re.compile(r"assert (False|success)$")
_CHILD_SAYS = re.compile(r"^Subprocess has error: (.*)", re.M)
_CHILD_ERROR = re.compile(r"^((?:[\w.]+(?:Error|Exception)\b:?.*)|.*(error while loading shared "
                          r"libraries: .*))$", re.M)


def reasons(report: Path) -> dict[str, str]:
    """nodeid -> the first line of each failure's or skip's message; for a failed example,
    with the first error its child printed (what the assertion that it succeeded hides)."""
    found, cases = {}, dict(_cases(report))
    for nodeid, (outcome, message) in outcomes(report).items():
        if outcome == PASS:
            continue
        line = first_line(message)
        if outcome == FAIL and _HARNESS.match(line):
            said = _CHILD_SAYS.search(cases[nodeid].findtext("system-out") or "")
            error = _CHILD_ERROR.search(cases[nodeid].findtext("system-err") or "")
            if said or error:
                line += "; child: " + first_line(said.group(1) if said else
                                                  error.group(2) or error.group(1))
        found[nodeid] = first_line(line, 200)
    return found


def table(reports: Sequence[tuple[str, Path]],
          expected: Mapping[str, str] | None = None) -> str:
    """A markdown table: one row per test any report lists, an outcome column per report
    (`no report` where it left none, `not run` where its report lacks the test), EXPECTED's
    column where given, then the first line of each failure's or skip's message."""
    runs = [(name, outcomes(path) if path.is_file() else None) for name, path in reports]
    why = {name: reasons(path) if path.is_file() else {} for name, path in reports}
    # the tests the reports list; where none left one, EXPECTED's (all rows say no report)
    nodeids = sorted({n for _, found in runs if found for n in found} or (expected or {}))
    cell = lambda s: s.replace("|", "\\|")   # noqa: E731
    head = ["upstream test", *(name for name, _ in runs)]
    if expected is not None:
        head.append("sublet expected (UPSTREAM, one GPU)")
    head += [f"{name}: first line of its message" for name, _ in runs]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for nodeid in nodeids:
        got = [(found or {}).get(nodeid, ("no report" if found is None else "not run", ""))
               for _, found in runs]
        row = [f"`{nodeid}`", *(outcome for outcome, _ in got)]
        if expected is not None:
            row.append(expected.get(nodeid, "not listed"))
        row += [cell(why[name].get(nodeid, "")) for name, _ in runs]
        lines.append("| " + " | ".join(row) + " |")
    counts = []
    for name, found in runs:
        if found is None:
            counts.append(f"- {name}: no report")
            continue
        tally = {o: sum(1 for out, _ in found.values() if out == o) for o in (PASS, FAIL, SKIP)}
        counts.append(f"- {name}: " + ", ".join(f"{n} {o}" for o, n in tally.items()))
    if len(runs) >= 2 and all(found is not None for _, found in runs):
        differ = sum(1 for n in nodeids
                     if len({(found.get(n) or ("not run",))[0] for _, found in runs}) > 1)
        counts.append(f"- outcomes that differ between {' and '.join(n for n, _ in runs)}: "
                      f"{differ} of {len(nodeids)}")
    return "\n".join([*counts, "", *lines]) + "\n"


def _gpu_column() -> dict[str, str] | None:
    """UPSTREAM's column for one CUDA GPU (what sublet's drop-in should do), where
    test_compat_tms_upstream imports (it needs torch and pytest)."""
    try:
        import conftest  # noqa: F401 (puts sublet's checkout on the path, as in the tests)
        from test_compat_tms_upstream import UPSTREAM
    except Exception as exc:   # noqa: BLE001 (the table is written without it)
        print(f"(no UPSTREAM column: {type(exc).__name__}: {exc})", file=sys.stderr)
        return None
    return {nodeid: row[1] for nodeid, row in UPSTREAM.items()}


def main(argv: list[str]) -> int:
    if len(argv) >= 3 and argv[0] == "pytest":
        from conftest import CHILD_ENV   # sublet's checkout on the path, as in the tests
        target, ini = Path(argv[1]).resolve(), Path(argv[2]).resolve()
        os.chdir(UPSTREAM_DIR)
        command = pytest_command(ini, argv[3:])
        os.execve(command[0], command, child_env(target, {**os.environ, **CHILD_ENV}))
    if len(argv) >= 3 and argv[0] == "table" and all("=" in a for a in argv[2:]):
        reports = [(name, Path(path)) for name, path in (a.split("=", 1) for a in argv[2:])]
        text = table(reports, _gpu_column())
        Path(argv[1]).write_text(text)
        print(text.split("\n\n", 1)[0])
        return 0
    print("usage:\n" + __doc__[__doc__.index("    python3 tests/"):], file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
