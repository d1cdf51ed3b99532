"""Fixtures of the engine tests."""

from lending_helpers import make_cluster

__all__ = ["make_cluster"]
