"""How a finished multi-rank process ends (``verl_ds.dist.exit_after_shutdown``): its exit code, everything it
printed and logged flushed, and nothing after it run (no interpreter teardown, where a rank used to abort now and
then); a single process returns the code instead (tests call ``main()`` in-process)."""
import subprocess
import sys

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
