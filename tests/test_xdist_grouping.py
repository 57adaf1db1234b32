"""The test command's premise (`pytest -n 2 --dist loadgroup`): tests marked with one `xdist_group` run on one
worker, so vLLM tests run one at a time on a 2-core machine and module fixtures (a warmed-up model, three RL runs)
are built once. pytest 9.2 with pytest-xdist 3.8 silently dropped the groups (pytest-dev/pytest-xdist#1386; every
package's `test` extra pins pytest < 9.2): this fails if that happens again."""

import pytest


@pytest.mark.xdist_group("grouping_check")
def test_xdist_groups_reach_the_scheduler(request: pytest.FixtureRequest):
    if not getattr(request.config.option, "loadgroup", False):
        pytest.skip("runs under `pytest -n N --dist loadgroup` (README's test command)")
    # loadgroup sends a group to one worker by the "@<group>" suffix it adds to the node id at collection
    assert request.node.nodeid.endswith("@grouping_check"), (
        f"node id {request.node.nodeid!r} has no '@grouping_check' suffix: --dist loadgroup ignores xdist_group "
        "with this pytest / pytest-xdist pair; install pytest < 9.2 (scripts/setup.sh does)"
    )
