"""Soak: a live training job with the control server on takes a scripted mix of valid, invalid and hostile requests
(the hostile corpus three times, the requests that used to kill a run, and valid hot changes) while it trains. It
stays alive; every accepted change is applied at its announced step and audited; no refused one reaches the state or
the audit log; the process's memory stays within a few MB. The figures are printed (pytest -s)."""
import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from e2e_utils import FAST, ROOT, TRAIN, base_env, merged, read_metrics
from hostile_requests import CORPUS, Case, send
from server_testutil import TOKEN, IdleFlood, call

pytestmark = pytest.mark.slow  # real training runs / several processes

# requests that were accepted (202) and then killed the run at the next step boundary (issue 12)
ONCE_FATAL = [
    Case("temperature 5e-324", "PATCH", "/v1/state", (("Authorization", "Bearer {token}"),), b'{"temperature": 5e-324}', 400),
    Case("temperature 1e-38", "PATCH", "/v1/state", (("Authorization", "Bearer {token}"),), b'{"temperature": 1e-38}', 400),
    Case("max_new_tokens 1048576", "PATCH", "/v1/state", (("Authorization", "Bearer {token}"),),
         b'{"max_new_tokens": 1048576}', 400),
    Case("reward weight 1e309", "POST", "/v1/models/reward", (("Authorization", "Bearer {token}"),),
         b'{"functions":[{"name":"parity","weight":1e309}]}', 400),
    Case("per_token not a bool", "POST", "/v1/models/reward", (("Authorization", "Bearer {token}"),),
         b'{"functions":[{"name":"parity","per_token":"no"}]}', 400),
    Case("builtins:print", "POST", "/v1/models/reward", (("Authorization", "Bearer {token}"),),
         b'{"function":"builtins:print"}', 400),
    # issue 31 items 6-8: finite in float64 but not in the float32 scores; a data field the task lacks; per_token
    Case("reward weight 1e300", "POST", "/v1/models/reward", (("Authorization", "Bearer {token}"),),
         b'{"functions":[{"name":"parity","weight":1e300}]}', 400),
    Case("reward weight 1e39", "POST", "/v1/models/reward", (("Authorization", "Bearer {token}"),),
         b'{"functions":[{"name":"parity","weight":1e39}]}', 400),
    Case("exact_match without answers", "POST", "/v1/models/reward", (("Authorization", "Bearer {token}"),),
         b'{"function":"exact_match"}', 400),
    Case("per_token on parity", "POST", "/v1/models/reward", (("Authorization", "Bearer {token}"),),
         b'{"functions":[{"name":"parity","per_token":true}]}', 400),
]


def _rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as fh:
        return next(int(line.split()[1]) for line in fh if line.startswith("VmRSS:"))


def _logged_steps(out: str) -> int:
    path = os.path.join(out, "metrics.jsonl")
    return sum(1 for _ in open(path)) if os.path.isfile(path) else 0


def test_soak_of_valid_invalid_and_hostile_requests_while_training(tmp_path):
    out = str(tmp_path / "run")
    args = [sys.executable, TRAIN, *merged([f"trainer.output_dir={out}"], FAST, [
        "trainer.total_steps=100000", "trainer.val_every=0", "trainer.export=none", "server.enabled=true",
        "algo.kl_ctrl=fixed", "algo.kl_coef=0.01"])]
    log = open(tmp_path / "train.log", "w")
    proc = subprocess.Popen(args, cwd=ROOT, env=base_env(VERL_DS_SERVER_TOKEN=TOKEN), stdout=log,
                            stderr=subprocess.STDOUT)
    try:
        while _logged_steps(out) < 3:  # the server is up and a few steps are done (the allocator has settled)
            assert proc.poll() is None, open(tmp_path / "train.log").read()[-5000:]
            time.sleep(0.1)
        port = int(open(os.path.join(out, "server_url.txt")).read().strip().rsplit(":", 1)[1])
        rss_before = _rss_kib(proc.pid)
        t0 = time.perf_counter()
        sent, wrong, accepted = 0, [], []
        cases = [c for c in CORPUS if not c.mutates] * 3 + ONCE_FATAL
        for i, case in enumerate(cases):
            answer = send(case, port, TOKEN)
            sent += 1
            if answer.status != case.status:
                wrong.append((case.name, case.status, answer.status))
            if i % 40 == 0:  # valid hot changes in between, each with a value no other request uses
                value = round(0.011 + 0.001 * len(accepted), 6)
                ok = send(Case("kl_coef", "PATCH", "/v1/state", (("Authorization", "Bearer {token}"),),
                               json.dumps({"kl_coef": value}).encode(), 202), port, TOKEN)
                sent += 1
                assert ok.status == 202, ok
                accepted.append((value, ok.json["applies_at_step"]))
        soak_s = time.perf_counter() - t0
        rss_after = _rss_kib(proc.pid)
        target = max(step for _, step in accepted) + 1
        while _logged_steps(out) <= target:  # every accepted change has taken effect
            assert proc.poll() is None, open(tmp_path / "train.log").read()[-5000:]
            time.sleep(0.1)
        assert proc.poll() is None  # alive after all of it
        proc.send_signal(signal.SIGUSR1)  # stop cleanly: checkpoint, exit 75
        assert proc.wait(timeout=600) == 75
    finally:
        if proc.poll() is None:
            proc.kill()
        log.close()
    print(f"\nsoak: {sent} requests in {soak_s:.1f} s, {len(accepted)} accepted changes, RSS "
          f"{rss_before / 1024:.1f} -> {rss_after / 1024:.1f} MiB ({(rss_after - rss_before) / 1024:+.1f} MiB)")
    assert sent >= 200 and not wrong, wrong
    assert rss_after - rss_before < 16 * 1024, (rss_before, rss_after)
    steps = {m["step"]: m for m in read_metrics(out) if "rollout/score/mean" in m}
    audit = [json.loads(line) for line in open(os.path.join(out, "state_changes.jsonl"))]
    for value, step in accepted:  # applied at the announced step, on the step's metrics and in the audit log
        assert abs(steps[step]["actor/kl_coef"] - value) < 1e-6 or \
            any(v2 != value and s2 == step for v2, s2 in accepted), (value, step, steps[step]["actor/kl_coef"])
        assert any(a["step"] == step and a["key"] == "kl_coef" and a["new"] == value for a in audit), (value, step)
    assert {a["key"] for a in audit} == {"kl_coef"}  # nothing refused reached the audit log
    assert all(m["state/temperature"] == 1.0 for m in steps.values())
    assert all(m["response_length/mean"] <= 6 for m in steps.values())  # max_new_tokens never changed


def _train_while(out: str, proc, log_path, probe, steps: int = 3, limit_s: float = 240.0) -> tuple[int, float]:
    """Call ``probe()`` every 0.2 s until the job has logged ``steps`` more steps (or ``limit_s`` passed);
    (steps trained, seconds)."""
    start, t0 = _logged_steps(out), time.monotonic()
    while _logged_steps(out) < start + steps and time.monotonic() - t0 < limit_s:
        assert proc.poll() is None, open(log_path).read()[-5000:]
        probe()
        time.sleep(0.2)
    return _logged_steps(out) - start, time.monotonic() - t0


def _timed(results: list, url: str, *args, **kwargs) -> None:
    """Append (status, seconds) of one request; status 0 when it got no answer within 60 s."""
    t = time.perf_counter()
    try:
        status = call(url, *args, timeout=60, **kwargs).status
    except OSError:
        status = 0
    results.append((status, time.perf_counter() - t))


def test_training_goes_on_under_pathological_bodies_and_an_idle_flood(tmp_path):
    """Four clients sending 64 KB bodies that once cost ~28 s of CPU each with the GIL held (0 steps in 112 s),
    then 300 idle sockets that reconnect as soon as one is closed (cap 256): the job keeps training through
    each, every body is refused (400) within seconds, /healthz and /v1/state answer 200 every time, and the job
    stops cleanly."""
    out, log_path = str(tmp_path / "run"), tmp_path / "train.log"
    args = [sys.executable, TRAIN, *merged([f"trainer.output_dir={out}"], FAST,
                                          ["trainer.total_steps=100000", "trainer.val_every=0",
                                           "trainer.export=none", "server.enabled=true"])]
    log = open(log_path, "w")
    proc = subprocess.Popen(args, cwd=ROOT, env=base_env(VERL_DS_SERVER_TOKEN=TOKEN), stdout=log,
                            stderr=subprocess.STDOUT)
    bad = b'"' + b'\\"' * 32000
    try:
        while _logged_steps(out) < 2:
            assert proc.poll() is None, open(log_path).read()[-5000:]
            time.sleep(0.1)
        url = open(os.path.join(out, "server_url.txt")).read().strip()
        answers, health, stop = [], [], threading.Event()

        def send_bad():
            while not stop.is_set():
                _timed(answers, url, "PATCH", "/v1/state", raw=bad, token=TOKEN)

        senders = [threading.Thread(target=send_bad) for _ in range(4)]
        for t in senders:
            t.start()
        try:
            bodies_phase = _train_while(out, proc, log_path, lambda: _timed(health, url, "GET", "/healthz"))
        finally:
            stop.set()
            for t in senders:
                t.join(120)
        reads = []
        with IdleFlood(int(url.rsplit(":", 1)[1]), 300, max_reopen=20000):
            flood_phase = _train_while(out, proc, log_path, lambda: (_timed(health, url, "GET", "/healthz"),
                                                                     _timed(reads, url, "GET", "/v1/state")))
        assert proc.poll() is None
        proc.send_signal(signal.SIGUSR1)  # stop cleanly: checkpoint, exit 75
        assert proc.wait(timeout=600) == 75
    finally:
        if proc.poll() is None:
            proc.kill()
        log.close()
    print(f"\nbodies: {bodies_phase[0]} steps in {bodies_phase[1]:.1f} s, {len(answers)} sent (slowest "
          f"{max(d for _, d in answers):.2f} s); flood: {flood_phase[0]} steps in {flood_phase[1]:.1f} s; "
          f"{len(health)} health checks (slowest {max(d for _, d in health):.2f} s)")
    assert bodies_phase[0] >= 3 and flood_phase[0] >= 3, (bodies_phase, flood_phase)
    assert answers and {s for s, _ in answers} == {400} and max(d for _, d in answers) < 10.0
    assert {s for s, _ in health + reads} == {200} and max(d for _, d in health + reads) < 10.0
