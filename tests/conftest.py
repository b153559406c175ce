"""Test-suite settings. Under CI (the environment variable CI is set) hypothesis runs
derandomized and without its example database, so a submission's result depends on its code
alone; runs elsewhere keep exploring new random examples."""

import os

import pytest
from hypothesis import settings

from mtplx_runtime.artifact.integrity import RECEIPTS_ENV

if os.environ.get("CI"):
    settings.register_profile("ci", derandomize=True, database=None)
    settings.load_profile("ci")


@pytest.fixture(autouse=True, scope="session")
def _receipts_in_a_temporary_directory(tmp_path_factory):
    """Integrity receipts (artifact/integrity.py) go to a directory of this run, not the user's
    cache: a test never trusts a shard because an earlier run hashed it."""
    old = os.environ.get(RECEIPTS_ENV)
    os.environ[RECEIPTS_ENV] = str(tmp_path_factory.mktemp("receipts"))
    yield
    if old is None:
        os.environ.pop(RECEIPTS_ENV, None)
    else:
        os.environ[RECEIPTS_ENV] = old
