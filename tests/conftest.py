"""Shared fixtures: one real 4-rank Dask cluster for the whole test session, and the pure
meshes the planner and layout tests use (no cluster)."""

import os
import shutil
import tempfile

import pytest

import dtorch
from dtorch import init_device_mesh


def pytest_configure(config):
    """The cost model's fitted links go to a directory of this test session's (never the
    user's ~/.cache/dtorch); kernels and workers the tests start inherit it."""
    if "DTORCH_CACHE_DIR" not in os.environ:
        os.environ["DTORCH_CACHE_DIR"] = tempfile.mkdtemp(prefix="dtorch-test-cache-")
        config._dtorch_cache = os.environ["DTORCH_CACHE_DIR"]


def pytest_unconfigure(config):
    made = getattr(config, "_dtorch_cache", None)
    if made:
        shutil.rmtree(made, ignore_errors=True)


@pytest.fixture(scope="session")
def cluster():
    """The embedded LocalCluster with 4 worker processes (started once, torn down at the end)."""
    controller = dtorch.init(n_workers=4)
    yield controller
    dtorch.shutdown()


@pytest.fixture
def live(cluster):
    """The running controller (restarted by a test that killed a worker)."""
    from dtorch.runtime import session
    return session.get_controller()


@pytest.fixture
def other_cluster(live):
    """``start(**init_kwargs)`` replaces the session cluster (8 ranks, a dry run, ...); the
    4-rank one is back after the test."""
    import gc

    def start(**kwargs):
        gc.collect()  # handles of earlier tests must not keep the old cluster "in use"
        dtorch.shutdown()
        return dtorch.init(**kwargs)
    yield start
    gc.collect()
    dtorch.shutdown()
    dtorch.init(n_workers=4)


@pytest.fixture
def mesh1d(live):
    return init_device_mesh("cpu", 4)


@pytest.fixture
def mesh2d(live):
    return init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))


@pytest.fixture
def m4():
    """A 1-D mesh of 4 ranks for pure (no cluster) tests."""
    return init_device_mesh("cpu", 4)


@pytest.fixture
def m22():
    """A 2x2 ("dp", "tp") mesh for pure (no cluster) tests."""
    return init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
