"""How a finished multi-rank process ends (``verl_ds.dist.exit_after_shutdown``): its exit code, everything it
printed and logged flushed, and nothing after it run (no interpreter teardown, where a rank used to abort now and
then); a single process returns the code instead (tests call ``main()`` in-process). A rank that fails or is
preempted ends the same way with its status."""
import json
import os
import subprocess
import sys

import pytest

from verl_ds.dist import free_port

SCRIPT = r'''
import atexit, logging, sys
from verl_ds.dist import exit_after_shutdown
logging.basicConfig(filename=sys.argv[1], level=logging.INFO)
atexit.register(lambda: print("atexit ran"))
assert exit_after_shutdown(5, 1) == 5  # one process: returned
print("summary", end="")  # no newline: only a flush writes it
sys.stderr.write("on stderr")
logging.getLogger("verl_ds").info("logged before the exit")
exit_after_shutdown(3, 2)
print("not reached")
'''


def test_exit_after_shutdown_flushes_and_ends_the_process(tmp_path):
    log = tmp_path / "run.log"
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(log)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 3, proc.stderr
    assert proc.stdout == "summary"  # printed and flushed; neither "not reached" nor the atexit handler ran
    assert proc.stderr.endswith("on stderr")
    assert "logged before the exit" in log.read_text()


FAILING_RANK = r'''
import atexit, json, os, sys
import torch.distributed as dist
from verl_ds import cli, dist as vdist
from verl_ds.runtime.preemption import Preempted

how = sys.argv[2]

def command(argv):
    # registered first, so it runs last (atexit is last in, first out): after verl_ds's own exit handler
    atexit.register(lambda: json.dump({"initialized_at_exit": dist.is_initialized()}, open(sys.argv[1], "w")))
    vdist.init_distributed(vdist.detect_launch(), 60, "cpu")
    vdist.barrier()
    if how == "preempted":
        raise Preempted("SIGUSR1", 3, None)
    if how == "error":
        raise RuntimeError("an unexplained error")
    if how == "message":
        sys.exit("stopped with a message")
    return 2  # an explained failure (main printed its line)

cli._main = command  # the command's body; main's ending is under test
code = cli.main([])
print("not reached", code)
'''


@pytest.mark.parametrize("how,code", [("preempted", 75), ("error", 1), ("message", 1), ("returned", 2)])
def test_a_failed_rank_of_two_exits_with_its_status_after_the_exit_handlers(tmp_path, how, code):
    """cli.main on a rank of a multi-rank run: a preemption, an error or a failure status ends the process with that
    status through ``end_failed_process`` (``sys.exit("...")``: the message and 1, as the interpreter gives). The
    interpreter's exit handlers run (verl_ds's ends the group); the C++ finalisation (where such a rank sometimes
    aborted with -6) does not."""
    env = {**os.environ, "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
           "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, "-c", FAILING_RANK, str(tmp_path / f"rank{r}.json"), how],
                              env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in range(2)]
    outs = [p.communicate(timeout=120) for p in procs]
    for r, (proc, (out, err)) in enumerate(zip(procs, outs)):
        assert proc.returncode == code, err
        assert "not reached" not in out
        assert json.loads((tmp_path / f"rank{r}.json").read_text()) == {"initialized_at_exit": False}
        assert ("RuntimeError: an unexplained error" in err) is (how == "error")
        assert ("stopped with a message" in err) is (how == "message")
