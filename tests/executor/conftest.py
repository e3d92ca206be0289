"""The rank processes of tests/tp_harness.py stay up across a module's run_ranks calls; they end
with the module, so no test module sees another's processes."""
import pytest

from tests.tp_harness import close_rank_pools


@pytest.fixture(scope="module", autouse=True)
def _rank_pools():
    yield
    close_rank_pools()
