import segcache  # noqa: F401  (first: binds the system BLAS before mlx loads)

import functools

import pytest

from segcache.testing import models


@functools.lru_cache(maxsize=None)
def tiny(family: str, seed: int = 0):
    """A tiny random-weight model, built once per session."""
    return models.build(family, seed=seed)


@pytest.fixture(params=models.FAMILIES)
def family(request):
    return request.param


@pytest.fixture(params=models.HYBRID)
def hybrid(request):
    return request.param


@pytest.fixture
def redis_server(tmp_path):
    """A redis-server (or valkey-server) on a free loopback port, stopped after the test."""
    from redis_util import RedisServer

    srv = RedisServer(tmp_path / "redis").start()
    try:
        yield srv
    finally:
        srv.stop()
