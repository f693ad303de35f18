"""Environment knobs (python/pcie_a2a/env.py): defaults, parsing and the errors for bad values."""

from __future__ import annotations

import pytest

from pcie_a2a import env

COPY_ENGINE_CASES = [
    (None, env.COPY_ENGINE_MIN_BYTES_DEFAULT),
    ("", env.COPY_ENGINE_MIN_BYTES_DEFAULT),
    ("0", 0),
    ("1048576", 1 << 20),
    (" 4096 ", 4096),
    ("off", None),
    ("OFF", None),
    ("-1", None),
]


@pytest.mark.parametrize(("value", "want"), COPY_ENGINE_CASES)
def test_copy_engine_min_bytes(monkeypatch, value, want):
    if value is None:
        monkeypatch.delenv("PCIE_A2A_COPY_ENGINE_MIN_BYTES", raising=False)
    else:
        monkeypatch.setenv("PCIE_A2A_COPY_ENGINE_MIN_BYTES", value)
    assert env.copy_engine_min_bytes() == want


@pytest.mark.parametrize("value", ["1.5", "-2", "lots", "1e6"])
def test_copy_engine_min_bytes_rejects_bad_values(monkeypatch, value):
    monkeypatch.setenv("PCIE_A2A_COPY_ENGINE_MIN_BYTES", value)
    with pytest.raises(
        ValueError, match=r"PCIE_A2A_COPY_ENGINE_MIN_BYTES=.*byte count >= 0 or 'off'"
    ):
        env.copy_engine_min_bytes()


def test_require_native_tools_turns_a_missing_tool_skip_into_a_failure(monkeypatch):
    """The CUDA execution model and SASS tests skip for a missing tool, except in CI."""
    from native_emulation import skip_or_fail

    monkeypatch.delenv("PCIE_A2A_REQUIRE_NATIVE_TOOLS", raising=False)
    with pytest.raises(pytest.skip.Exception, match="nvcc not found"):
        skip_or_fail("nvcc not found")
    monkeypatch.setenv("PCIE_A2A_REQUIRE_NATIVE_TOOLS", "1")
    with pytest.raises(pytest.fail.Exception, match="REQUIRE_NATIVE_TOOLS=1 but nvcc not found"):
        skip_or_fail("nvcc not found")
