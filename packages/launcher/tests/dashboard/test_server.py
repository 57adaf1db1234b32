import json
import threading
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from prime_rl.launcher.dashboard.registry import MAX_ROWS_PER_RUN, RunRegistry
from prime_rl.launcher.dashboard.server import build_server, main, parse_args

from .helpers import append_metrics, make_run


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    server = build_server(tmp_path, port=0)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    host, port = server.server_address[:2]
    yield f"http://{host}:{port}", tmp_path
    server.shutdown()
    server.server_close()


def get(url: str) -> tuple[int, str, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=10) as resp:
            return resp.status, resp.headers["Content-Type"], resp.read()
    except urllib.error.HTTPError as e:
        return e.code, e.headers["Content-Type"], e.read()


def state(base: str, since: dict | None = None) -> dict:
    query = "?since=" + urllib.parse.quote(json.dumps(since)) if since is not None else ""
    status, ctype, body = get(f"{base}/api/state{query}")
    assert status == 200 and ctype == "application/json"
    return json.loads(body)


def test_page_static_and_api(served: tuple[str, Path]) -> None:
    base, root = served
    status, ctype, body = get(base + "/")
    assert status == 200 and ctype.startswith("text/html")
    assert b"/static/uPlot.iife.min.js" in body and str(root).encode() in body
    status, _, js = get(base + "/static/uPlot.iife.min.js")
    assert status == 200 and js.startswith(b"/*! https://github.com/leeoniya/uPlot")
    for bad in ["/static/../server.py", "/static/%2e%2e/server.py", "/static/nope.js", "/elsewhere"]:
        assert get(base + bad)[0] == 404, bad
    assert get(base + "/api/state?since=[1]")[0] == 400


def test_state_sends_only_missing_rows(served: tuple[str, Path]) -> None:
    base, root = served
    run = make_run(root, "exp/a", steps=3)
    make_run(root, "exp/b", steps=0)
    append_metrics(run, {}, raw="garbage\n")
    first = state(base)
    assert first["keys"] == ["loss/mean", "reward/mean"]
    a, b = first["runs"]
    assert (a["name"], a["latest_step"], a["skipped_lines"], len(a["rows"])) == ("exp/a", 3, 1, 3)
    assert a["figures"]["reward"] == {"key": "reward/mean", "value": 0.3, "nonfinite": False}
    assert a["figures"]["throughput"] is None

    append_metrics(run, {}, raw='{"step": 4, "loss/mean": NaN}\n')  # a diverged loss shows as such
    nan = state(base, {"exp/a": [a["epoch"], 3]})["runs"][0]
    assert nan["figures"]["loss"] == {"key": "loss/mean", "value": None, "nonfinite": True}
    assert nan["nonfinite"] == {"loss/mean": 4} and [r["step"] for r in nan["rows"]] == [4]

    assert (b["name"], b["num_rows"], b["has_metrics_file"], b["latest_step"]) == ("exp/b", 0, False, None)

    append_metrics(run, {"step": 5, "reward/mean": 0.4})
    again = state(base, {"exp/a": [a["epoch"], 4]})
    a2 = next(r for r in again["runs"] if r["name"] == "exp/a")
    assert a2["start"] == 4 and [r["step"] for r in a2["rows"]] == [5]
    # A stale epoch from the client means: send everything again.
    a3 = next(r for r in state(base, {"exp/a": [99, 3]})["runs"] if r["name"] == "exp/a")
    assert a3["start"] == 0 and len(a3["rows"]) == 5

    # online evals: the "eval reward" column is the newest eval/<env>/reward_mean, not pass@k or lengths
    append_metrics(run, {}, raw='{"step": 4, "eval/arith/completion_len_mean": 7.0, "eval/arith/reward_mean": 0.75}\n')
    ev = state(base, {"exp/a": [a["epoch"], 5]})["runs"][0]
    assert ev["figures"]["eval reward"] == {"key": "eval/arith/reward_mean", "value": 0.75, "nonfinite": False}
    assert a["figures"]["eval reward"] is None


def test_large_backlog_is_paged(tmp_path: Path) -> None:
    run = make_run(tmp_path, "big")
    n = MAX_ROWS_PER_RUN + 10
    append_metrics(run, {}, raw="".join(json.dumps({"step": s, "x": s}) + "\n" for s in range(n)))
    registry = RunRegistry(tmp_path)
    first = registry.snapshot()["runs"][0]
    assert len(first["rows"]) == MAX_ROWS_PER_RUN and first["more"]
    rest = registry.snapshot({"big": [0, MAX_ROWS_PER_RUN]})["runs"][0]
    assert len(rest["rows"]) == 10 and not rest["more"]


def test_deleted_run_disappears(tmp_path: Path) -> None:
    import shutil

    run = make_run(tmp_path, "gone", steps=1)
    registry = RunRegistry(tmp_path, rescan_interval_s=0)
    assert [r["name"] for r in registry.snapshot()["runs"]] == ["gone"]
    shutil.rmtree(run)
    assert registry.snapshot()["runs"] == []


def test_cli_rejects_bad_path(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main([str(tmp_path / "missing")])
    assert exc.value.code == 2
    assert "is not a folder" in capsys.readouterr().err
    args = parse_args([str(tmp_path), "--port", "9000", "--host", "0.0.0.0"])
    assert (args.port, args.host) == (9000, "0.0.0.0")
