"""The reference matches the code: the README's example code runs, and every
public name of the library has a docstring (the API reference, ``bash .ci/docs``, is built
from them)."""

from __future__ import annotations

import importlib
import inspect
import re

import pytest

from tests.support import ROOT

#: The modules the API reference documents (kept in step with .ci/docs).
PUBLIC_MODULES = ["kvpush", "kvpush.aio", "kvpush.prometheus", "kvpush.metrics",
                  "kvpush.request", "kvpush.producer", "kvpush.consumer", "kvpush.errors",
                  "kvpush.layout", "kvpush.messages", "kvpush.prefix", "kvpush.progress",
                  "kvpush.auth", "kvpush.protocol", "kvpush.discovery",
                  "kvpush.testing.peers", "kvpush.testing.proxy"]


def test_the_readmes_example_code_runs(capsys: pytest.CaptureFixture[str]) -> None:
    """Every ```python block of README.md, in order, in one namespace (they read as one
    session); it asserts what it claims, and closes what it opens."""
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    assert len(blocks) >= 2
    namespace: dict[str, object] = {"__name__": "readme"}
    for i, block in enumerate(blocks):
        exec(compile(block, f"README.md python block {i + 1}", "exec"), namespace)
    out = capsys.readouterr().out.split()
    assert out[0].startswith("tcp://") and out[1:] == ["none", "ended"]


def test_the_api_pages_example_test_passes() -> None:
    """The ```python block of docs/API.md's section on kvpush.testing defines an engine's
    test; each ``test_*`` it defines is run."""
    text = (ROOT / "docs" / "API.md").read_text()
    section = text[text.index("## Testing an integration"):]
    [block] = re.findall(r"```python\n(.*?)```", section, re.S)
    namespace: dict[str, object] = {"__name__": "api_example"}
    exec(compile(block, "docs/API.md kvpush.testing example", "exec"), namespace)
    tests = [fn for name, fn in namespace.items() if name.startswith("test_")]
    assert tests
    for test in tests:
        assert callable(test)
        test()


def test_every_public_name_has_a_docstring() -> None:
    missing: list[str] = []
    documented = set((ROOT / ".ci" / "docs").read_text().split())
    for modname in PUBLIC_MODULES:
        assert modname in documented, f"{modname} is not in .ci/docs"
        mod = importlib.import_module(modname)
        if not (mod.__doc__ or "").strip():
            missing.append(modname)
        for name in getattr(mod, "__all__", []):
            obj = getattr(mod, name)
            if (inspect.isclass(obj) or inspect.isfunction(obj)) \
                    and not (obj.__doc__ or "").strip():
                missing.append(f"{modname}.{name}")
            if not inspect.isclass(obj):
                continue
            for klass in obj.__mro__:
                if not klass.__module__.startswith("kvpush"):
                    continue
                for attr, value in vars(klass).items():
                    if attr.startswith("_"):
                        continue
                    if isinstance(value, (staticmethod, classmethod)):
                        value = value.__func__
                    if isinstance(value, property):
                        value = value.fget
                    elif not inspect.isfunction(value):
                        continue
                    if not (value.__doc__ or "").strip():
                        missing.append(f"{modname}.{name}.{attr}")
    assert not missing, sorted(set(missing))
