"""What can be checked of the pyslurm backend without pyslurm.

pyslurm has no release for Slurm 22.05 (the local cluster), so the backend's
calls into pyslurm never run here. These tests cover what does not need it:
the module imports without pyslurm, the constructor refuses to start without
it, the version comparison, and that the class still has every method of
``SchedulerBackend`` with the same parameters (catches drift of either side).
"""

from __future__ import annotations

import importlib
import inspect
import sys

import pytest

from sinks.backends.base import BackendError, SchedulerBackend


def _protocol_methods() -> dict[str, inspect.Signature]:
    return {
        name: inspect.signature(member)
        for name, member in vars(SchedulerBackend).items()
        if inspect.isfunction(member) and not name.startswith("_")
    }


def test_module_imports_without_pyslurm(monkeypatch: pytest.MonkeyPatch) -> None:
    # None in sys.modules makes any `import pyslurm` fail, installed or not.
    monkeypatch.setitem(sys.modules, "pyslurm", None)
    monkeypatch.delitem(sys.modules, "sinks.backends.pyslurm_backend", raising=False)
    module = importlib.import_module("sinks.backends.pyslurm_backend")
    assert module.PyslurmBackend.name == "pyslurm"


def test_constructor_without_pyslurm_raises_with_install_hint(monkeypatch: pytest.MonkeyPatch) -> None:
    from sinks.backends.pyslurm_backend import PyslurmBackend

    monkeypatch.setitem(sys.modules, "pyslurm", None)
    # slurm_version given so that the refusal cannot come from the scontrol probe.
    with pytest.raises(BackendError) as info:
        PyslurmBackend(slurm_version="24.05.1")
    message = str(info.value)
    assert "pyslurm is not installed" in message
    assert "pip install 'trainmedic[pyslurm]'" in message
    assert "it must match the site's Slurm major version" in message


def test_protocol_lists_methods() -> None:
    # Guards the drift test below against silently comparing nothing.
    assert {"drain_node", "requeue_job", "annotate_job", "job_state"} <= set(_protocol_methods())


@pytest.mark.parametrize("method", sorted(_protocol_methods()))
def test_method_matches_protocol_signature(method: str) -> None:
    from sinks.backends.pyslurm_backend import PyslurmBackend

    expected = _protocol_methods()[method]
    impl = getattr(PyslurmBackend, method, None)
    assert impl is not None and inspect.isfunction(impl), f"PyslurmBackend.{method} is missing"
    actual = inspect.signature(impl)
    # Both modules use postponed annotations, so annotations compare as source text.
    assert [(p.name, p.kind, p.annotation) for p in actual.parameters.values()] == [
        (p.name, p.kind, p.annotation) for p in expected.parameters.values()
    ]
    assert actual.return_annotation == expected.return_annotation


def test_structurally_a_scheduler_backend() -> None:
    from sinks.backends.pyslurm_backend import PyslurmBackend

    assert isinstance(PyslurmBackend.name, str)
    # __new__ skips the constructor (which needs pyslurm); the runtime protocol
    # check only looks at the attributes the class provides.
    assert isinstance(PyslurmBackend.__new__(PyslurmBackend), SchedulerBackend)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("24.5.1", (24, 5)),  # pyslurm drops the zero of Slurm's minor
        ("24.05.1", (24, 5)),
        ("slurm 22.05.8", (22, 5)),  # scontrol --version
        ("slurm-wlm 23.11.4\n", (23, 11)),
        ("25.5", (25, 5)),
    ],
)
def test_slurm_major(text: str, expected: tuple[int, int]) -> None:
    from sinks.backends.pyslurm_backend import slurm_major

    assert slurm_major(text) == expected


def test_check_versions_accepts_same_major() -> None:
    from sinks.backends.pyslurm_backend import check_versions

    check_versions("24.5.1", "slurm 24.05.4")
    check_versions("23.11.0", "23.11.10")


@pytest.mark.parametrize(
    ("pyslurm_version", "slurm_version"),
    [("24.5.1", "slurm 23.11.8"), ("23.2.2", "23.11.1"), ("24.11.0", "24.05.1")],
)
def test_check_versions_refuses_other_major(pyslurm_version: str, slurm_version: str) -> None:
    from sinks.backends.pyslurm_backend import check_versions

    with pytest.raises(BackendError) as info:
        check_versions(pyslurm_version, slurm_version)
    message = str(info.value)
    assert pyslurm_version in message and slurm_version in message
    assert "pip install 'trainmedic[pyslurm]'" in message


def test_check_versions_refuses_slurm_before_23_02() -> None:
    from sinks.backends.pyslurm_backend import check_versions

    # Slurm 22.05 (this project's cluster) has no pyslurm with the Node/Job API at all.
    with pytest.raises(BackendError, match="needs Slurm 23.02 or newer; use the slurm-cli"):
        check_versions("22.5.1", "slurm 22.05.8")


def test_check_versions_refuses_unparsable_version() -> None:
    from sinks.backends.pyslurm_backend import check_versions

    with pytest.raises(BackendError, match="pyslurm version check"):
        check_versions("", "24.05.1")
