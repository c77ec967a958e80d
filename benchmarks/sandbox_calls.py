"""Start-up cost per sandboxed call: calls per second of ``run_python('print(1)')`` on the weak backend (one
Python process with rlimits, Landlock and the audit hook: the sandbox before bubblewrap) and on bubblewrap's
(namespaces, a tmpfs, the seccomp filter), run alternately so the load moves both alike.

    python benchmarks/sandbox_calls.py            # 30 calls each
    python benchmarks/sandbox_calls.py --calls 5  # a smoke run

Prints one line: ``sandbox_calls old_calls_per_s=... bwrap_calls_per_s=... ratio=... load1=...``.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

from verl_ds.agent.sandbox import SandboxLimits, require_sandbox, run_python


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=30)
    args = ap.parse_args()
    print(require_sandbox(False), flush=True)
    limits = SandboxLimits(timeout_s=30)
    seconds = {"weak": [], "bwrap": []}
    for _ in range(args.calls):
        for backend in seconds:
            start = time.perf_counter()
            r = run_python("print(1)", limits, backend=backend)
            seconds[backend].append(time.perf_counter() - start)
            assert r.ok and r.stdout == "1\n", r
    old, new = (1 / statistics.median(seconds[b]) for b in ("weak", "bwrap"))
    print(f"sandbox_calls old_calls_per_s={old:.1f} bwrap_calls_per_s={new:.1f} ratio={new / old:.2f} "
          f"load1={os.getloadavg()[0]:.2f} calls={args.calls}")


if __name__ == "__main__":
    main()
