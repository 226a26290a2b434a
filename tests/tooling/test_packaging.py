"""The project's packaging metadata as setuptools reads it: every bootstrap and wheel build
reads ``pyproject.toml``, and a form setuptools deprecates is one it will refuse later."""

from __future__ import annotations

import warnings
from pathlib import Path

from setuptools.dist import Distribution
from setuptools.warnings import SetuptoolsDeprecationWarning

ROOT = Path(__file__).resolve().parents[2]


def test_pyproject_reads_without_deprecation_warnings() -> None:
    """``license`` as a table (``{ text = ... }``) is deprecated since setuptools 77, and
    setuptools warns of it on every build until it refuses it: the license is an SPDX
    expression."""
    from setuptools.config.pyprojecttoml import apply_configuration

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dist = apply_configuration(Distribution(), ROOT / "pyproject.toml")
    deprecations = [str(w.message) for w in caught
                    if issubclass(w.category, SetuptoolsDeprecationWarning)]
    assert deprecations == []
    assert dist.metadata.license_expression == "Apache-2.0"
