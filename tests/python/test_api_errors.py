"""Argument errors and environment checks of the Python API. No daemon, no GPU."""

from __future__ import annotations

import re
import weakref

import pytest
import torch

import sublet
from sublet import _lib, _memory, _torch
from sublet._lib import error_for

from conftest import REPO


class _FakeRegion:
    """Stands for a daemon's region so that lend() argument checks run without a daemon."""

    def __init__(self, tensor: torch.Tensor):
        self.size = self.nbytes = tensor.untyped_storage().nbytes()
        self.addr = tensor.untyped_storage().data_ptr()
        self.lent = False


@pytest.fixture
def sublet_like_tensor():
    tensor = torch.zeros(8, 16, dtype=torch.uint8)
    region = _FakeRegion(tensor)
    addr = tensor.untyped_storage().data_ptr()
    _memory._registry[addr] = weakref.ref(region)
    yield tensor
    _memory._registry.pop(addr, None)


# --------------------------------------------------------------------------- lend / keep

def test_lend_refuses_a_tensor_sublet_did_not_make():
    with pytest.raises(ValueError, match=r"sublet\.empty"):
        sublet.lend(torch.zeros(4))


def test_lend_refuses_a_non_tensor():
    with pytest.raises(TypeError, match="torch.Tensor"):
        sublet.lend([1, 2, 3])


def test_keep_view_of_another_tensor(sublet_like_tensor):
    other = torch.zeros(8, 16, dtype=torch.uint8)
    with pytest.raises(ValueError, match="not a view of the lent tensor"):
        sublet.lend(sublet_like_tensor, keep=[sublet_like_tensor[0], other[1]])


def test_keep_of_wrong_type(sublet_like_tensor):
    with pytest.raises(TypeError, match="keep"):
        sublet.lend(sublet_like_tensor, keep="all")


def test_offer_checks_keep_before_lending(sublet_like_tensor):
    with pytest.raises(ValueError, match="not a view"):
        sublet.offer(sublet_like_tensor, keep=torch.zeros(3))


def test_loan_empty_outside_a_loan(sublet_like_tensor):
    loan = sublet.lend(sublet_like_tensor, keep=[])
    with pytest.raises(RuntimeError, match="only while the loan is active"):
        loan.empty(4)
    with pytest.raises(RuntimeError, match="has not started"):
        loan.stats


# --------------------------------------------------------------------------- empty

@pytest.mark.parametrize("size, dtype, error", [
    ((4,), "float32", TypeError),
    ((4,), torch.float32.itemsize, TypeError),
    ((-1,), torch.float32, TypeError),
    ((2.5,), torch.float32, TypeError),
    ((0, 4), torch.float32, ValueError),
])
def test_empty_argument_errors(size, dtype, error):
    with pytest.raises(error):
        sublet.empty(*size, dtype=dtype)


def test_empty_size_forms():
    assert _memory.parse_size((2, 3)) == (2, 3)
    assert _memory.parse_size(((2, 3),)) == (2, 3)
    assert _memory.parse_size((torch.Size([2, 3]),)) == (2, 3)
    assert _memory.nbytes_of((2, 3), torch.bfloat16) == 12


@pytest.mark.parametrize("device", ["cuda", "cuda:1", torch.device("cuda", 0), 0])
def test_cuda_device_on_the_memfd_backend_names_the_fix(monkeypatch, device):
    # Refused before CUDA is asked anything (no driver here: its error would say only that).
    monkeypatch.setenv("SUBLET_BACKEND", "memfd")
    with pytest.raises(ValueError, match=r"needs sublet's cuda backend.*SUBLET_BACKEND=memfd.*"
                                         r"device='cpu'"):
        sublet.empty(4, device=device)


@pytest.mark.parametrize("device, error, match", [
    ("meta", ValueError, "CUDA devices, not meta"),
    (1.5, TypeError, "a str such as 'cuda:0'"),
    (True, TypeError, "a str such as 'cuda:0'"),
])
def test_device_forms_torch_empty_refuses_too(monkeypatch, device, error, match):
    monkeypatch.setenv("SUBLET_BACKEND", "memfd")
    with pytest.raises(error, match=match):
        sublet.empty(4, device=device)


def test_cuda_device_that_does_not_exist_says_which_exist(monkeypatch):
    monkeypatch.setenv("SUBLET_BACKEND", "cuda")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5")
    with pytest.raises(ValueError, match=r"cuda:2 does not exist: this process sees 2 CUDA "
                                         r"device\(s\) \(CUDA_VISIBLE_DEVICES=4,5\)"):
        sublet.empty(4, device="cuda:2")


def test_dtype_forms_of_torch_empty():
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        assert _memory.as_dtype(None) == torch.float64
    finally:
        torch.set_default_dtype(previous)
    assert [_memory.as_dtype(t) for t in (bool, int, float, complex, torch.bfloat16)] == [
        torch.empty(0, dtype=t).dtype for t in (bool, int, float, complex, torch.bfloat16)]


def test_unknown_keyword_of_empty_names_what_it_takes(monkeypatch):
    monkeypatch.setenv("SUBLET_BACKEND", "memfd")
    with pytest.raises(TypeError, match=r"\['layout'\].*dtype, device and requires_grad"):
        sublet.empty(4, layout=torch.strided)


def test_cpu_device_needs_the_memfd_backend(monkeypatch):
    monkeypatch.setenv("SUBLET_BACKEND", "cuda")
    with pytest.raises(ValueError, match="SUBLET_BACKEND=memfd"):
        sublet.empty(4, device="cpu")


def test_unknown_backend(monkeypatch):
    monkeypatch.setenv("SUBLET_BACKEND", "rocm")
    with pytest.raises(ValueError, match="'cuda' or 'memfd'"):
        sublet.empty(4)


# --------------------------------------------------------------------------- torch checks

@pytest.mark.parametrize("version", ["2.7.1", "2.16.0", "3.0.0", "1.13.1+cu117"])
def test_unsupported_torch_versions_are_refused(version):
    with pytest.raises(RuntimeError, match=r"2\.8 to 2\.15.*SUBLET_SKIP_TORCH_CHECK=1"):
        _torch.check_torch_version(version, environ={})


@pytest.mark.parametrize("version", ["2.8.0", "2.9.0a0+git1234", "2.11.0+cu130",
                                     "2.15.0+cu132", "2.15.3"])
def test_supported_torch_versions(version):
    _torch.check_torch_version(version, environ={})


def test_skip_torch_check(monkeypatch):
    _torch.check_torch_version("2.16.0", environ={"SUBLET_SKIP_TORCH_CHECK": "1"})
    monkeypatch.setattr(torch, "__version__", "2.7.0")
    monkeypatch.setenv("SUBLET_SKIP_TORCH_CHECK", "1")
    _torch.check_torch_version()
    monkeypatch.delenv("SUBLET_SKIP_TORCH_CHECK")
    with pytest.raises(RuntimeError, match="not 2.7.0"):
        _torch.check_torch_version()


@pytest.mark.parametrize("env", [
    {"PYTORCH_CUDA_ALLOC_CONF": "backend:cudaMallocAsync"},
    {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True, backend: cudaMallocAsync"},
    {"PYTORCH_ALLOC_CONF": "backend:cudaMallocAsync"},
])
def test_cuda_malloc_async_is_refused(env):
    with pytest.raises(RuntimeError, match="MemPool"):
        _torch.check_alloc_conf(env)


@pytest.mark.parametrize("env", [
    {}, {"PYTORCH_CUDA_ALLOC_CONF": "backend:native"},
    {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True,max_split_size_mb:128"},
])
def test_other_allocator_settings_pass(env):
    _torch.check_alloc_conf(env)


# --------------------------------------------------------------------------- errors and lib

def test_error_codes_match_the_header():
    header = (REPO / "include" / "sublet.h").read_text()
    declared = dict((name, int(value)) for name, value in
                    re.findall(r"X\((E\w+),\s*(-\d+),", header))
    assert declared == _lib.ERROR_CODES


@pytest.mark.parametrize("name, cls", [
    ("ELEAK", sublet.LeakError), ("ENOOFFER", sublet.NoOfferError),
    ("EOWNERGONE", sublet.OwnerGoneError), ("EBORROWERDIED", sublet.BorrowerDiedError),
    ("ECONNREFUSED", sublet.DaemonUnavailableError), ("EPIPE", sublet.DaemonUnavailableError),
    ("EPROTO", sublet.ProtocolError), ("EVERSION", sublet.ProtocolError),
    ("EBUSY", sublet.BusyError), ("EINVAL", sublet.InvalidArgumentError),
])
def test_codes_map_to_exceptions(name, cls):
    error = error_for(_lib.ERROR_CODES[name], "what to do")
    assert type(error) is cls and isinstance(error, RuntimeError)
    assert isinstance(error, ValueError) == (name == "EINVAL")  # PyTorch's argument errors
    assert error.code == _lib.ERROR_CODES[name] and error.code_name == name
    assert "what to do" in str(error)


@pytest.mark.parametrize("name", ["ENOMEM", "ENOHOSTMEM"])
def test_out_of_memory_is_torch_out_of_memory(name):
    # What a PyTorch user catches: `except torch.OutOfMemoryError` (torch.cuda's, the same).
    error = error_for(_lib.ERROR_CODES[name], "no room")
    assert type(error) is sublet.SubletOutOfMemoryError
    assert isinstance(error, torch.OutOfMemoryError)
    assert isinstance(error, torch.cuda.OutOfMemoryError)
    assert isinstance(error, MemoryError) and isinstance(error, sublet.SubletError)
    assert issubclass(sublet.SubletOutOfMemoryError, torch.OutOfMemoryError)


def test_joining_torch_out_of_memory_twice_changes_nothing():
    bases = sublet.SubletOutOfMemoryError.__bases__
    _lib.join_torch_out_of_memory(torch.OutOfMemoryError)
    assert sublet.SubletOutOfMemoryError.__bases__ == bases


def test_stats_reprs_give_sizes_as_people_read_them():
    loan = _lib.LoanStats(
        loan_id=7, copied_out_bytes=3 << 19, copied_in_bytes=3 << 19, served_unkept_bytes=1 << 30,
        served_fresh_bytes=0, served_kept_bytes=2 << 20, peak_bytes=(1 << 30) + (2 << 20),
        allocations=12, map_seconds=0.0012, copy_out_seconds=0.25, copy_in_seconds=0.5,
        borrower_died=True, owner_gone=False, moved_bytes=512, move_seconds=0.0,
        mapped_pages=3)
    assert repr(loan) == (
        "<sublet.LoanStats of loan 7: served 1.00 GiB unkept, 0 B fresh, 2.00 MiB kept (peak "
        "1.00 GiB, 12 allocations); 1.50 MiB to the host, 1.50 MiB back, 512 B moved; 0.001 s "
        "mapping (3 pages), 0.250 s copying out, 0.500 s in, 0.000 s moving; borrower died>")
    release = _lib.ReleaseStats(
        release_id=2, released_pages=7, stayed_pages=1, kept_bytes=64 << 10,
        moved_bytes=56 << 10, copied_out_bytes=0, copied_in_bytes=0, seconds=0.004,
        move_seconds=0.001, copy_seconds=0.0, map_seconds=0.002)
    assert repr(release) == (
        "<sublet.ReleaseStats of release 2: 7 pages released, 1 stayed holding 64.00 KiB kept "
        "(56.00 KiB moved); 0 B to the host, 0 B back; 0.004 s (0.001 s moving, 0.000 s "
        "copying, 0.002 s mapping)>")


def test_timeout_is_a_builtin_timeout_error():
    error = error_for(_lib.ERROR_CODES["ETIMEDOUT"], "slow")
    assert isinstance(error, TimeoutError) and isinstance(error, sublet.SubletError)


def test_missing_native_file_names_the_fix(monkeypatch, tmp_path):
    monkeypatch.setenv("SUBLET_LIB", str(tmp_path / "nope.so"))
    with pytest.raises(FileNotFoundError, match=r"pip install \.|cmake"):
        _lib.find_native("libsublet.so", "SUBLET_LIB")


def test_a_native_file_beside_sublet_lib_is_of_the_same_build(monkeypatch, tmp_path):
    """$SUBLET_LIB names a build of one's own: its preload library and subletd are found
    there, not in the repo's build/, which may be older (a stale preload library lacked a
    symbol the Python side called)."""
    beside = tmp_path / "torch_memory_saver_hook_mode_preload.abi3.so"
    beside.write_bytes(b"")
    monkeypatch.setenv("SUBLET_LIB", str(tmp_path / "libsublet.so"))
    monkeypatch.delenv("SUBLET_TMS_PRELOAD", raising=False)
    assert _lib.find_native(beside.name, "SUBLET_TMS_PRELOAD") == beside.resolve()


def test_status_without_any_daemon_exits_3_and_names_the_fix(capsys, monkeypatch, tmp_path):
    from sublet import _status
    monkeypatch.delenv("SUBLET_SOCKET", raising=False)
    monkeypatch.setattr(_status, "SYSTEM_SOCKET_DIR", tmp_path)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))  # no daemon of ours either
    assert _status.main(["status", "--json"]) == 3
    assert "systemctl start subletd@0.socket" in capsys.readouterr().err


def test_every_function_of_the_header_has_a_prototype():
    header = (REPO / "include" / "sublet.h").read_text()
    declared = set(re.findall(r"SUBLET_EXPORT[^;(]*?\b(sublet_\w+)\s*\(", header))
    assert declared and declared == set(_lib._PROTOTYPES)
