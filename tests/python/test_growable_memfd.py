"""Growable regions through the ctypes layer (sublet._lib.Client) on the memfd backend: a
region grows in place, its bytes intact, and each refusal is the typed error it should be.
The pools (sublet._pool) build on this; test_pool_memfd.py tests them."""

from __future__ import annotations

import ctypes

import pytest

import sublet
from sublet._client import client_for
from sublet._lib import BusyError, SubletError, SubletOutOfMemoryError

from conftest import PAGE, TOTAL

pytestmark = [pytest.mark.daemon, pytest.mark.usefixtures("memfd_daemon")]


def view(addr: int, size: int):
    return (ctypes.c_ubyte * size).from_address(addr)


def test_a_region_grows_in_place():
    client = client_for("memfd", 0)
    region = client.region_create_growable(3 * PAGE + 1)
    assert region.size == 4 * PAGE
    view(region.addr, 4 * PAGE)[:] = bytes(range(256)) * (4 * PAGE // 256)
    size = 4 * PAGE
    for grown in (5 * PAGE, 9 * PAGE - 1, 40 * PAGE):
        size = client.region_grow(region, grown)
        assert size == -(-grown // PAGE) * PAGE
        mem = view(region.addr, size)  # the same address: the region grew where it was
        assert bytes(mem[:4 * PAGE]) == bytes(range(256)) * (4 * PAGE // 256)
        mem[size - 1] = 0xAB
        assert mem[size - 1] == 0xAB
    with pytest.raises(SubletError) as e:
        client.region_grow(region, size)  # not larger
    assert e.value.code == sublet._lib.ERROR_CODES["EINVAL"]
    with pytest.raises(SubletOutOfMemoryError):
        client.region_grow(region, TOTAL + 1)
    loan, _ = client.lend(region, None, None)
    with pytest.raises(BusyError):
        client.region_grow(region, size + PAGE)
    client.withdraw(loan)
    assert client.region_grow(region, size + PAGE) == size + PAGE
    client.region_release(region)


def test_a_plain_region_does_not_grow():
    client = client_for("memfd", 0)
    region = client.region_create(PAGE)
    with pytest.raises(SubletError, match="growable"):
        client.region_grow(region, 2 * PAGE)
    client.region_release(region)
