"""Continuous batching on segcache's runtime (issue 11): B rows, one forward per step."""

from .decoder import BatchDecoder
from .runtime import BatchRuntime

__all__ = ["BatchDecoder", "BatchRuntime"]
