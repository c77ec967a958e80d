"""The request corpus of hostile_requests.py against a real server: each case gets its documented status
(as JSON), only the valid changes are staged, and the server stays healthy under a concurrent replay."""
import threading

from hostile_requests import CORPUS, send
from server_testutil import TOKEN, call

from verl_ds.server import ControlServer


def _mismatches(cases, port):
    bad = []
    for case in cases:
        try:
            a = send(case, port, TOKEN)
        except OSError as e:
            bad.append((case.name, repr(e)))
            continue
        text_answer = case.path.startswith("/metrics") or (case.method == "HEAD")
        body_ok = text_answer or (a.json is not None and (a.status < 400 or a.json.get("status") == a.status))
        # answers before authentication repeat nothing the client sent: no '<redacted>' marking the token's place
        if a.status in (404, 405, 505) and (TOKEN in a.text or "<redacted>" in a.text or "G0776" in a.text):
            body_ok = False
        if a.status != case.status or not body_ok:
            bad.append((case.name, case.status, a.status, a.text[:160]))
    return bad


def test_every_case_gets_its_status_and_only_valid_changes_are_staged(parts):
    assert len(CORPUS) >= 98 and len({c.name for c in CORPUS}) == len(CORPUS)
    with ControlServer(parts["state"], parts["registry"], port=0, token=TOKEN, reward_swapper=parts["swapper"],
                       metrics_fn=parts["metrics"].snapshot, request_timeout=5.0) as srv:
        assert _mismatches(CORPUS, srv.port) == []
        assert sorted(s["key"] for s in parts["state"].staged()) == ["gamma", "lam"]
        assert [s["functions"][0]["name"] for s in parts["swapper"].staged] == ["parity"]
        # a replay of the non-mutating cases from 4 threads at once: the same answers, a healthy server
        replay = [c for c in CORPUS if not c.mutates]
        results = [None] * 4
        threads = [threading.Thread(target=lambda i=i: results.__setitem__(i, _mismatches(replay, srv.port)))
                   for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        assert results == [[], [], [], []]
        assert call(srv.url, "GET", "/healthz").status == 200
        assert len(parts["state"].staged()) == 2 and len(parts["swapper"].staged) == 1
