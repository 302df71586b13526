"""What CI runs and what the docs tell a newcomer to run agree.

- The README's two commands: the first installs and runs the quickstart, the second is the test
  command, and .ci/run runs that same command.
- .ci/run runs the Python tests a second time on the oldest torch sublet claims (the floor of
  pyproject.toml's range), through tests/oldest-torch; in that run SUBLET_TEST_TORCH says which
  torch the tests must find, and they check it (a system torch shadowing the venv's fails).
- No doc tells a user to `pip install sublet` from an index (sublet is published on none):
  they say how to get the wheel.
"""

from __future__ import annotations

import os
import re
import subprocess

import pytest

from conftest import REPO

pytestmark = pytest.mark.skipif(not (REPO / ".ci" / "run").is_file(),
                                reason="needs the checkout (.ci/run, README.md)")


def ci_commands() -> list[str]:
    """.ci/run's command lines, comments and blank lines left out."""
    lines = (REPO / ".ci" / "run").read_text().splitlines()
    return [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]


def readme_two_commands() -> list[str]:
    text = (REPO / "README.md").read_text()
    section = re.search(r"^## Two commands\n(.*?)^## ", text, re.M | re.S).group(1)
    block = re.search(r"```sh\n(.*?)```", section, re.S).group(1)
    commands, current = [], ""
    for line in block.splitlines():
        current += " " + line.split("  #")[0].strip()
        if not line.rstrip().endswith(("\\", "&&", "|")):
            commands.append(current.strip())
            current = ""
    return [c for c in commands if c]


def test_the_readme_has_two_commands_and_ci_runs_the_second():
    first, second = readme_two_commands()
    assert "pip install '.[test]'" in first and "examples/quickstart.py" in first
    assert second in ci_commands(), f"README's test command {second!r} is not run by .ci/run"


def test_ci_runs_the_python_tests_on_the_oldest_torch():
    from sublet import _torch
    assert "tests/oldest-torch" in ci_commands()
    asked = subprocess.run([str(REPO / "tests" / "oldest-torch"), "--requirement"],
                           capture_output=True, text=True, check=True).stdout.strip()
    lo_major, lo_minor = _torch.SUPPORTED_TORCH[0]
    assert asked == f"torch=={lo_major}.{lo_minor}.*"


@pytest.mark.skipif(not os.environ.get("SUBLET_TEST_TORCH"),
                    reason="SUBLET_TEST_TORCH is set by tests/oldest-torch")
def test_running_on_the_torch_asked_for():
    import torch
    from sublet import _torch
    asked = tuple(int(n) for n in os.environ["SUBLET_TEST_TORCH"].split("."))
    assert _torch.parse_torch_version(torch.__version__) == asked, torch.__version__


def test_no_doc_says_pip_install_sublet_from_an_index():
    """sublet is on no package index: `pip install sublet` would find nothing, or someone
    else's package. The docs install a checkout (`pip install .`) or a wheel file."""
    docs = [REPO / "README.md", *(REPO / "docs").rglob("*.md"), *(REPO / "deploy").rglob("*"),
            *(REPO / "man").glob("*.[0-9]")]
    found = []
    for path in docs:
        if not path.is_file():
            continue
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if re.search(r"pip install (-\S+ )*['\"]?sublet(\[[^\]]*\])?['\"]?(?![-\w./*])", line):
                found.append(f"{path.relative_to(REPO)}:{n}: {line.strip()}")
    assert found == [], found


def readme_env_table() -> set[str]:
    text = (REPO / "README.md").read_text()
    section = re.search(r"^## Environment variables\n(.*?)^## ", text, re.M | re.S).group(1)
    rows = [line for line in section.splitlines() if line.startswith("| `")]
    return {v for row in rows for v in re.findall(r"`([A-Z][A-Z0-9_]+)`", row.split("|")[1])}


def test_every_environment_variable_sublet_reads_is_in_the_readme():
    """Each SUBLET_* name the package or the C code reads (a string literal there) has a row in
    the README's table, and each row names something the code reads."""
    code = [*(REPO / "sublet").rglob("*.py"), *(REPO / "client").glob("*.c"),
            *(REPO / "daemon").rglob("*.c"), *(REPO / "common").glob("*.c"),
            *(REPO / "preload").glob("*.c")]
    read = set()
    for path in code:
        read |= set(re.findall(r"[\"'](SUBLETD?(?:_[A-Z0-9]+)*)[\"']", path.read_text()))
    table = readme_env_table()
    assert read - table == set(), "read by the code but not in the README's table"
    everything = "".join(p.read_text() for p in code)
    assert {v for v in table if f'"{v}"' not in everything} == set(), "in the table, read nowhere"


def test_help_lists_every_option_main_c_parses(native):
    """subletd --help (which test_daemon_cli.py holds against the man page) names every long
    option of daemon/main.c's getopt table: none is parsed but undocumented."""
    source = (REPO / "daemon" / "main.c").read_text()
    parsed = set(re.findall(r'\{"([a-z][a-z-]*)",\s*(?:no|required|optional)_argument', source))
    assert {"pin", "socket", "device"} <= parsed
    helptext = subprocess.run([str(native.subletd), "--help"], capture_output=True, text=True,
                              check=True).stdout
    shown = set(re.findall(r"^\s+(?:-\w, )?--([a-z][a-z-]*)", helptext, re.M))
    assert parsed - shown == set(), "parsed by subletd but not in its --help"


def test_the_readme_cpu_only_torch_is_within_sublets_range():
    """The README's CPU-only PyTorch command asks for the range pyproject.toml declares: a
    torch outside it would be replaced by PyPI's CUDA build at `pip install '.[test]'`."""
    readme = (REPO / "README.md").read_text()
    asked = re.search(r"pip install '(torch[^']*)' --index-url https://download\.pytorch\.org"
                      r"/whl/cpu", readme)
    assert asked, "the README says how to take a CPU-only torch"
    declared = re.search(r'^dependencies = \["(torch[^"]*)"',
                         (REPO / "pyproject.toml").read_text(), re.M).group(1)
    assert asked.group(1) == declared
