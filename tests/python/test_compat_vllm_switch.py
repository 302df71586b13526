"""The vLLM switch without vLLM (CI's base environment): what turns it on, the install step
that pip sees, the version check's messages, and the one list of tested versions that the
docs' support table, the GPU replay's orders and CI's installs all follow."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from sublet.compat import vllm_switch, vllm_versions
from sublet.compat.__main__ import main as compat_main

from test_compat_tms_install import files_under, run_in, venv, venv_site  # noqa: F401
from vllm_orders import ORDERS

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def no_env(monkeypatch):
    monkeypatch.delenv(vllm_switch.ENV, raising=False)
    monkeypatch.delenv(vllm_versions.ALLOW_ENV, raising=False)


@pytest.mark.parametrize("value, installed, on", [
    ("1", False, True), ("on", False, True), ("0", True, False), ("false", True, False),
    ("", True, True), ("", False, False)])
def test_what_turns_the_switch_on(no_env, monkeypatch, value, installed, on):
    if value:
        monkeypatch.setenv(vllm_switch.ENV, value)
    monkeypatch.setattr(vllm_switch, "installed", lambda: installed)
    assert vllm_switch.wanted() is on


def test_a_switch_value_it_does_not_know_says_which_it_does(no_env, monkeypatch):
    monkeypatch.setenv(vllm_switch.ENV, "maybe")
    with pytest.raises(ValueError, match="set it to 1 .* or 0"):
        vllm_switch.wanted()


def test_install_then_pip_sees_it_and_uninstall_removes_it(venv):
    """The install step, as a user runs it in a venv: pip lists sublet-vllm-switch, the switch
    is on, and pip's own uninstall takes it away (off again), leaving the venv as it was."""
    site = venv_site(venv)
    before = files_under(site)
    out = run_in(venv, "-m", "sublet.compat", "install", "vllm")
    assert out.returncode == 0, out.stderr
    assert "pip uninstall sublet-vllm-switch" in out.stdout
    listed = run_in(venv, "-m", "pip", "list", "--path", str(site), "--format", "freeze")
    assert "sublet-vllm-switch==1" in listed.stdout, listed.stdout + listed.stderr
    probe = "from sublet.compat import vllm_switch as s; print(s.installed())"
    assert run_in(venv, "-c", probe).stdout == "True\n"
    gone = run_in(venv, "-m", "pip", "uninstall", "-y", "sublet-vllm-switch")
    assert gone.returncode == 0 and "Successfully uninstalled" in gone.stdout, gone.stderr
    assert run_in(venv, "-c", probe).stdout == "False\n"
    assert {f for f in files_under(site) if "__pycache__" not in f} == \
        {f for f in before if "__pycache__" not in f}


def test_uninstall_step_and_a_second_uninstall(tmp_path, capsys):
    assert compat_main(["install", "vllm", "--target", str(tmp_path)]) == 0
    assert compat_main(["uninstall", "vllm", "--target", str(tmp_path)]) == 0
    assert "vLLM's own again" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="not installed"):
        compat_main(["uninstall", "vllm", "--target", str(tmp_path)])


def test_install_refuses_an_untested_vllm(tmp_path, monkeypatch):
    monkeypatch.setattr(vllm_versions, "installed", lambda: "0.35.0")
    with pytest.raises(SystemExit, match=r"tested with vLLM 0\.24\.0.*not with the installed "
                                         r"0\.35\.0.*pip install vllm==0\.34\.0"):
        compat_main(["install", "vllm", "--target", str(tmp_path)])
    assert list(tmp_path.iterdir()) == []


def test_the_check_names_the_versions_and_the_way_out(no_env, monkeypatch):
    assert vllm_versions.check("0.34.0") == "0.34.0"
    with pytest.raises(vllm_versions.UntestedVLLMError,
                       match=r"0\.23\.0: install one of those \(pip install vllm==0\.24\.0\)"
                             r".*SUBLET_VLLM_ALLOW_UNTESTED=1.*SUBLET_VLLM=0"):
        vllm_versions.check("0.23.0")
    monkeypatch.setenv(vllm_versions.ALLOW_ENV, "1")
    assert vllm_versions.check("0.23.0") == "0.23.0"   # asked for: a warning, no error


def test_one_list_of_tested_versions():
    """vllm_versions.TESTED is the one list: the GPU replay's orders, the support table of
    docs/compat-vllm.md and the versions CI installs (tests/vllm-env) name the same ones."""
    tested = list(vllm_versions.TESTED)
    assert list(ORDERS) == tested
    table = (REPO / "docs/compat-vllm.md").read_text()
    assert re.findall(r"^\| (\d+\.\d+\.\d+) \|", table, re.M) == tested
    ci = (REPO / "tests/vllm-env").read_text()
    assert "vllm_versions.TESTED" in ci   # it installs that list, read from the package
