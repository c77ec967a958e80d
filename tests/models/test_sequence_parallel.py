"""DeepSpeed-Ulysses sequence parallelism (``verl_ds.models.sequence_parallel``) on 2 gloo ranks in float64: the same
packed micro-batch split over the two ranks (model.sequence_parallel_size=2) gives the log-probs, entropies, values
and (summed over the group) parameter gradients of the row run unsplit on one rank, for plain packing, shared
prompts and prefixes, and the fused LM head."""
import json
import os
import socket
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # several processes

WORKER = os.path.join(os.path.dirname(__file__), "sp_worker.py")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("sp")
    port = _free_port()
    procs = [subprocess.Popen([sys.executable, WORKER, str(out)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              env={**os.environ, "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": "2",
                                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"})
             for r in range(2)]
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=300)[0].decode(errors="replace"))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert all(p.returncode == 0 for p in procs), "\n".join(log[-3000:] for log in logs)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.parametrize("case", ["packed", "shared", "fused", "fused_shared"])
def test_split_row_scores_and_gradients_equal_the_unsplit_row(results, case):
    for r in results:
        got = r[case]
        assert got["lp_scale"] > 0.1  # log-probs of a random model: far from 0
        # the policy returns float32 log-probs (its contract): equal to the unsplit row's after that rounding
        assert got["log_probs"] <= 1e-6 and got["entropy"] <= 1e-6, got
        assert got["grads"] <= 1e-6 and got["grad_count"] == 21, got  # every parameter, through float32 log-probs


def test_split_row_values_and_critic_gradients_equal_the_unsplit_row(results):
    for r in results:
        got = r["values"]
        assert got["values"] <= 1e-12 and got["grads"] <= 1e-12 and got["grad_count"] == 22, got


def test_split_row_full_symmetric_kl_equals_the_unsplit_row(results):
    """algo.kl_kind=full_symmetric: the reference's hidden states of this rank's slice meet the actor's same rows."""
    for r in results:
        got = r["full_kl"]
        assert got["kl_scale"] > 1e-3 and got["kl"] <= 1e-6 * got["kl_scale"] and got["grads"] <= 1e-6, got
