"""Fixtures of the API tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from served_models import Served, serve_hermes


@pytest.fixture(scope="module")
def hermes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """A random model whose chat template takes tools (Hermes style), served as ``tiny``."""
    with serve_hermes(tmp_path_factory.mktemp("hermes")) as served:
        yield served
