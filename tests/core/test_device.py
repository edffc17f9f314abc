"""Devices are parsed once, where they enter: one rule for what a device may be."""

from __future__ import annotations

import pytest

from weightcache.core.device import Device
from weightcache.core.request import LoadRequest

UUID = "GPU-5a1c2f3e-0000-4000-8000-0123456789ab"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("cpu", Device("cpu")),
        ("cuda", Device("cuda")),
        ("cuda:3", Device("cuda", index=3)),
        (UUID, Device("cuda", uuid=UUID)),
        (UUID.upper().replace("GPU-", "gpu-"), Device("cuda", uuid=UUID)),
        ("MIG-5a1c2f3e-0000-4000-8000-0123456789ab", Device("cuda", uuid="MIG-5a1c2f3e-0000-4000-8000-0123456789ab")),
    ],
)
def test_the_accepted_spellings(text, expected):
    assert Device.parse(text) == expected
    assert Device.parse(str(expected)) == expected  # round-trips through its text


@pytest.mark.parametrize("text", ["gpu", "mps", "banana", "cpu:0", "cuda0", "cuda:-1", "cuda:x", "GPU-not-a-uuid", ""])
def test_anything_else_is_refused_with_the_spellings(text):
    with pytest.raises(ValueError, match="is not a device weightcache can use; use 'cpu', 'cuda', 'cuda:N' or a GPU UUID"):
        Device.parse(text)


def test_a_torch_device_is_accepted():
    torch = pytest.importorskip("torch")
    assert Device.parse(torch.device("cpu")) == Device("cpu")
    assert Device.parse(torch.device("cuda", 1)) == Device("cuda", index=1)


def test_a_request_parses_its_device_and_dtype_once():
    request = LoadRequest(model="/m", device="cuda:1", dtype="torch.bfloat16")
    assert request.device == Device("cuda", index=1) and request.is_cuda and request.dtype == "bfloat16"
    assert LoadRequest(model="/m", dtype="auto").dtype is None
    with pytest.raises(ValueError, match="unsupported dtype 'bogus'"):
        LoadRequest(model="/m", dtype="bogus")
    with pytest.raises(ValueError, match="not a device"):
        LoadRequest(model="/m", device="gpu")
