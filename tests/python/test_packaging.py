"""What the published package promises: one version everywhere, the torch range that the run
time enforces, type information that type-checks `with sublet.lend(...)`, and (when testing the
installed wheel, SUBLET_TEST_INSTALLED=1) a manylinux wheel that carries its C libraries."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

import sublet
from sublet import _torch

from conftest import INSTALLED, REPO


def cmake_version() -> str:
    text = (REPO / "CMakeLists.txt").read_text()
    return re.search(r"project\(sublet VERSION ([0-9.]+)", text).group(1)


def torch_requirement() -> str:
    if INSTALLED:
        reqs = metadata.requires("sublet") or []
    else:
        tomllib = pytest.importorskip("tomllib")
        reqs = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    (torch_req,) = [r for r in reqs if re.match(r"torch\b", r)]
    return torch_req.replace(" ", "")


def test_one_version_from_cmake(native):
    assert sublet.__version__ == cmake_version()
    out = subprocess.run([str(native.subletd), "--version"], capture_output=True, text=True)
    assert out.stdout.startswith(f"subletd {cmake_version()} ")
    if INSTALLED:
        assert metadata.version("sublet") == cmake_version()


def test_declared_torch_range_is_the_checked_one():
    (lo_major, lo_minor), (hi_major, hi_minor) = _torch.SUPPORTED_TORCH
    name, specifiers = re.match(r"(torch)(.*)", torch_requirement()).groups()
    # The wheel's metadata may reorder the specifiers: compare them as a set.
    assert set(specifiers.split(",")) == {f">={lo_major}.{lo_minor}", f"<{hi_major}.{hi_minor + 1}"}


# What the tests import that the README's `pip install '.[test]'` must bring, or they are
# skipped for a newcomer (module: distribution). Left out on purpose: mypy (the type check
# skips cleanly without it), matplotlib (bench plots), triton (GPU tests).
TEST_IMPORTS = {"pytest": "pytest", "yaml": "pyyaml", "transformers": "transformers",
                "scikit_build_core": "scikit-build-core"}


def test_test_extra_brings_what_the_tests_import():
    tomllib = pytest.importorskip("tomllib")
    extra = tomllib.loads((REPO / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]["test"]
    names = {re.match(r"[A-Za-z0-9_.]+(?:-[A-Za-z0-9_.]+)*", r).group(0).lower() for r in extra}
    assert set(TEST_IMPORTS.values()) <= names, extra


def test_py_typed_is_shipped():
    assert (Path(sublet.__file__).parent / "py.typed").is_file()


TYPED_USE = """
import torch, sublet
cache = sublet.empty(4, 1024, dtype=torch.uint8)
with sublet.lend(cache, keep=cache[1::2]) as loan:
    pass
n: int = loan.copied_bytes
with sublet.offer(cache, name="kv") as offer:
    offer.wait(timeout=1.0)
with sublet.borrow(name="kv", timeout=1.0) as borrowed:
    x: torch.Tensor = borrowed.empty(16, dtype=torch.uint8)
with sublet.pool("kv") as kv:
    layers = [kv.empty(2, 64, 16) for _ in range(4)]
with sublet.lend("kv", keep=sublet.blocks(layers, [0, 3], dim=1)):
    pass
version: str = sublet.__version__
"""

# A typo in a sublet name is an error for mypy --strict (a module __getattr__ would make it Any).
TYPO_USE = """
import sublet
t = sublet.emtpy(4)
"""


def every_name_use() -> str:
    """A file naming every public name of sublet: __all__, and all the lazy __getattr__ serves
    at run time (each an error under --strict unless __all__ exports it)."""
    names = sorted(set(sublet.__all__) | set(sublet._LAZY) | {"__version__"})
    return "import sublet\n" + "".join(f"n{i} = sublet.{n}\n" for i, n in enumerate(names))


def test_every_public_name_is_exported_and_served():
    # What the lazy __getattr__ serves is public at run time: __all__ must say so too.
    assert set(sublet._LAZY) <= set(sublet.__all__)
    for name in sublet.__all__:
        assert getattr(sublet, name) is not None, name


def mypy_available() -> bool:
    """Whether the run below can work: it is `sys.executable -m mypy`, so what counts is this
    interpreter's mypy, not a `mypy` on PATH (another venv's, pipx's), which it never runs."""
    return _has_module("mypy")


def test_mypy_skip_asks_the_interpreter_that_runs_it(tmp_path, monkeypatch):
    # A mypy on PATH that this Python cannot import (tests/run in a venv, another mypy on
    # PATH) is a skip, not a failure of `python -m mypy`.
    (tmp_path / "mypy").write_text("#!/bin/sh\nexit 0\n")
    (tmp_path / "mypy").chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ.get('PATH', '')}")
    monkeypatch.setitem(sys.modules, "mypy", None)  # find_spec then answers None
    assert shutil.which("mypy") is not None
    assert not mypy_available()


@pytest.mark.parametrize("code, passes", [(TYPED_USE, True), (every_name_use(), True),
                                          (TYPO_USE, False)],
                         ids=["api", "every-name", "typo"])
def test_the_api_type_checks(tmp_path, code, passes):
    if not mypy_available():
        pytest.skip(f"mypy is not installed for {sys.executable} "
                    "(python3 -m pip install mypy; CI installs it)")
    (tmp_path / "use.py").write_text(code)
    # What is checked is the user's code against sublet's signatures: errors inside sublet are
    # not reported (as for any installed package), and torch is not analysed (slow): Any.
    (tmp_path / "mypy.ini").write_text("[mypy]\n[mypy-sublet.*]\nignore_errors = True\n"
                                       "[mypy-torch.*]\nfollow_imports = skip\n"
                                       "follow_imports_for_stubs = True\n")
    path = [] if INSTALLED else [str(REPO)]
    # --strict, as a typed project runs it: names not exported by sublet are errors then.
    r = subprocess.run([sys.executable, "-m", "mypy", "--strict", "--config-file", "mypy.ini",
                        "--no-incremental", "use.py"], cwd=tmp_path, capture_output=True,
                       text=True, timeout=600,
                       env={"PATH": "/usr/bin:/bin", "MYPYPATH": ":".join(path)})
    if passes:
        assert r.returncode == 0, r.stdout + r.stderr
    else:
        assert r.returncode == 1 and 'has no attribute "emtpy"' in r.stdout, r.stdout + r.stderr


def _has_module(name: str) -> bool:
    import importlib.util
    return importlib.util.find_spec(name) is not None


@pytest.mark.skipif(not INSTALLED, reason="tests the installed wheel (SUBLET_TEST_INSTALLED=1)")
def test_installed_wheel_is_manylinux_and_self_contained(native):
    package = Path(sublet.__file__).resolve().parent
    assert REPO not in package.parents, f"testing the checkout ({package}), not the install"
    wheel = metadata.distribution("sublet").read_text("WHEEL") or ""
    assert re.search(r"^Tag: py3-none-manylinux_2_\d+_x86_64$", wheel, re.M), wheel
    shipped = [str(f) for f in metadata.files("sublet") or []]
    bundled = ("libuv.copyright", "protobuf-c.copyright", "jansson.copyright")
    for name in ("LICENSE", *bundled):  # what the wheel carries, it carries the license of
        assert any(f.endswith(f"licenses/{name}") for f in shipped), name
    for binary in (native.subletd, native.libsublet):
        assert package in binary.resolve().parents
        ldd = subprocess.run(["ldd", str(binary)], capture_output=True, text=True).stdout
        for lib in ("libuv", "libprotobuf-c", "libjansson"):
            for line in ldd.splitlines():
                if lib in line:
                    assert "sublet.libs" in line, f"{binary.name} takes {lib} from the system"


@pytest.mark.skipif(not INSTALLED, reason="tests the installed wheel (SUBLET_TEST_INSTALLED=1)")
def test_installed_metadata_is_complete():
    meta = metadata.metadata("sublet")
    assert meta["Description-Content-Type"] == "text/markdown"
    assert meta["Description"].startswith("# sublet")  # the README: PyPI's project page
    assert "Apache-2.0" in (meta.get("License-Expression") or meta.get("License") or "")
    # No public repository or website yet (pyproject.toml): no link that points nowhere.
    assert not meta.get_all("Project-URL")
    classifiers = meta.get_all("Classifier")
    assert "Typing :: Typed" in classifiers and "Operating System :: POSIX :: Linux" in classifiers


# What building and testing leave in a checkout: the README's .venv (made for real below),
# tests/run's build/ and --sanitize's build-asan/, the libFuzzer build, the offline packages
# (.deps), the wheel's and the device's folders, Python's and the tools' caches. None of it
# belongs in an sdist or a Docker build context.
LEFTOVERS = (".venv", "venv", "build", "build-asan", "build-fuzz", "dist", "_skbuild", ".deps",
             ".whl", ".device", ".pytest_cache", ".mypy_cache", "sublet/__pycache__",
             "tests/python/__pycache__", "sublet.egg-info")


def tracked_files() -> list[str]:
    out = subprocess.run(["git", "-C", str(REPO), "ls-files", "-z"], capture_output=True,
                         check=True).stdout.decode().split("\0")
    return [name for name in out if name and (REPO / name).is_file()]


@pytest.mark.skipif(INSTALLED or not (REPO / ".git").exists(), reason="needs the git checkout")
def test_sdist_leaves_out_a_venv_and_build_trees(tmp_path):
    pytest.importorskip("scikit_build_core")
    src = tmp_path / "src"
    for name in tracked_files():
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / name, src / name)
    # A real venv, as the README's first command makes it (symlinks, pyvenv.cfg and all).
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(src / ".venv")],
                   check=True, timeout=120)
    for leftover in LEFTOVERS:  # as the README's steps and tests/run leave them
        (src / leftover / "lib").mkdir(parents=True, exist_ok=True)
        (src / leftover / "lib" / "leftover.py").write_text("# not sublet's\n")
    out = tmp_path / "dist-out"
    out.mkdir()
    subprocess.run([sys.executable, "-c", "import sys; from scikit_build_core.build import "
                    "build_sdist; print(build_sdist(sys.argv[1]))", str(out)], cwd=src,
                   check=True, capture_output=True, timeout=300)
    import tarfile
    (sdist,) = out.glob("sublet-*.tar.gz")
    with tarfile.open(sdist) as tar:
        names = [n.split("/", 1)[1] for n in tar.getnames() if "/" in n]
    assert "daemon/main.c" in names and "pyproject.toml" in names  # it is the sources
    assert [n for n in names if "leftover" in n or "pyvenv.cfg" in n or
            n.startswith(".venv")] == []
    # The README's wheel step can be followed from it: packaging/ whole (the "/build*"
    # exclusion is the checkout's build trees, not packaging/build-wheel).
    packaging = sorted(n for n in tracked_files() if n.startswith("packaging/"))
    assert "packaging/build-wheel" in packaging
    assert [n for n in packaging if n not in names] == []
    # The benchmarks' results and plot stay out (their scripts stay in).
    assert [n for n in names if n.startswith("bench/") and n.endswith((".log", ".json"))] == []
    assert [n for n in names if n.startswith("assets/")] == []
    assert "bench/benchmark.py" in names


def dockerignore_patterns() -> list[str]:
    lines = [line.strip() for line in (REPO / ".dockerignore").read_text().splitlines()]
    patterns = [line for line in lines if line and not line.startswith("#")]
    assert not [p for p in patterns if p.startswith("!")], "exceptions: extend docker_ignored"
    return patterns


def docker_ignored(path: str, patterns: list[str]) -> bool:
    """Whether Docker leaves path out of the build context: a pattern matches the path or a
    folder above it, from the context's root; `*` stays within one name; `**/` is any folders."""
    import fnmatch
    parts = path.split("/")
    for depth in range(1, len(parts) + 1):
        head = parts[:depth]
        for pattern in patterns:
            want = pattern.split("/")
            anywhere = want[0] == "**"
            want = want[1:] if anywhere else want
            have = head[-len(want):] if anywhere else head
            if len(have) == len(want) and all(map(fnmatch.fnmatchcase, have, want)):
                return True
    return False


def test_git_and_docker_ignore_what_building_leaves():
    if (REPO / ".git").exists():
        for leftover in LEFTOVERS:
            r = subprocess.run(["git", "-C", str(REPO), "check-ignore", "-q", "--no-index",
                                f"{leftover}/lib/x.py"])
            assert r.returncode == 0, f".gitignore does not ignore {leftover}/"
    patterns = dockerignore_patterns()
    for leftover in LEFTOVERS:
        assert docker_ignored(f"{leftover}/lib/x.py", patterns), f".dockerignore misses {leftover}"


@pytest.mark.skipif(INSTALLED or not (REPO / ".git").exists(), reason="needs the git checkout")
def test_docker_keeps_every_source():
    patterns = dockerignore_patterns()
    assert [name for name in tracked_files() if docker_ignored(name, patterns)] == []


def test_docker_ignored_reads_patterns_as_docker_does():
    assert docker_ignored("sublet/__pycache__/x.pyc", ["**/__pycache__"])
    assert docker_ignored("build-asan/x.o", ["build*"])
    assert not docker_ignored("tests/build/x", ["build*"])  # from the root only
    assert not docker_ignored("venvs.md", ["venv"]) and docker_ignored("venv/x", ["venv"])
