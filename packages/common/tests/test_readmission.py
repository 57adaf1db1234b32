"""When a restarted replica may serve behind the router again (readmission.py), and the router calls."""

from prime_rl.common.readmission import http_healthy, readmission_version, router_worker
from prime_rl.common.testing_http import serve_http


def test_a_restarted_replica_is_readmitted_only_at_the_version_the_others_serve() -> None:
    healthy, versions = [True, True, True], [0, 3, None]  # replica 2 is busy (no answer): not "not serving"
    probe = dict(healthy=lambda i: healthy[i], version=lambda i: versions[i])
    assert readmission_version(0, 3, {0}, **probe) is None  # model weights while the others serve 3
    versions[0] = 3
    assert readmission_version(0, 3, {0}, **probe) == 3
    healthy[0] = False
    assert readmission_version(0, 3, {0}, **probe) is None
    healthy[0], versions[1] = True, None  # no other replica answers: nothing to compare with, wait
    assert readmission_version(0, 3, {0}, **probe) is None


def test_with_no_other_replica_serving_answering_is_enough() -> None:
    """The orchestrator holds every request then, and its health probe through the router needs the replica
    listed again: waiting for a version nobody reports would never end."""
    probe = dict(healthy=lambda i: True, version=lambda i: 0)
    assert readmission_version(0, 1, {0}, **probe) == 0  # the only replica
    assert readmission_version(1, 2, {0, 1}, **probe) == 0  # both restarting
    assert readmission_version(0, 1, {0}, healthy=lambda i: True, version=lambda i: None) is None


def test_router_calls_and_health_probe() -> None:
    calls: list[tuple[str, str | None]] = []

    def post(request) -> int:
        calls.append((request.path, request.headers.get("Authorization")))
        return 200 if request.path.startswith("/add_worker") else 500

    httpd = serve_http(post=post)
    url = f"http://127.0.0.1:{httpd.server_address[1]}"
    try:
        assert http_healthy(url) and not http_healthy(f"{url}/nothing")
        assert router_worker(url, "add", "http://n1:9100", api_key="k") is None
        assert router_worker(url, "remove", "http://n1:9100").startswith("answered 500")
        assert calls == [
            ("/add_worker?url=http%3A%2F%2Fn1%3A9100", "Bearer k"),
            ("/remove_worker?url=http%3A%2F%2Fn1%3A9100", None),
        ]
    finally:
        httpd.shutdown()
        httpd.server_close()
    assert router_worker(url, "add", "http://n1:9100").startswith("failed: ")  # nobody listens now
