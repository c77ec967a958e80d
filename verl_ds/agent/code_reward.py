"""The ``code_tests`` reward: the response's last fenced Python block, run in the sandbox, then the row's tests in
its namespace; 1.0 only when the sandbox's harness saw the last test statement finish (a signed line on a channel
of its own, ``verl_ds.agent.sandbox_runner``), else 0.0: an exit of any kind before that (``sys.exit(0)``,
``os._exit(0)``, ``raise SystemExit(0)``, a signal) scores 0, whatever the exit status.

Assert-based tests check only what they assert: an answer returning an object whose ``__eq__`` always returns
True passes ``assert f(x) == y`` (docs/agents.md).

The data set gives the tests per row in a ``tests`` field (Python statements, e.g. ``assert add(2, 3) == 5``),
as code benchmarks do (MBPP's ``test_list``, HumanEval's ``check``). The programs run in parallel threads, each
in its own sandboxed process (``verl_ds.agent.sandbox``).
"""
from __future__ import annotations

import os
import re
from concurrent.futures import ThreadPoolExecutor

from verl_ds.agent.sandbox import SandboxLimits, run_python
from verl_ds.verifiable import extras_field

__all__ = ["code_tests_reward", "last_code_block"]

_BLOCK = re.compile(r"```(?:python|py)?[ \t]*\n(.*?)```", re.DOTALL)
LIMITS = SandboxLimits(timeout_s=10, cpu_s=5, memory_mb=512, max_output_bytes=1 << 14)


def last_code_block(response: str) -> str | None:
    """The last fenced code block (```python, ```py or bare ```), or None."""
    blocks = _BLOCK.findall(response)
    return blocks[-1] if blocks else None


def _score(code: str | None, tests) -> float:
    if code is None:
        return 0.0
    tests = "\n".join(tests) if isinstance(tests, (list, tuple)) else str(tests)
    return float(run_python(code, LIMITS, tests=tests + "\n").tests_passed is True)


def code_tests_reward(prompts: list, responses: list, batch) -> list[float]:
    """One float per response: 1.0 if its last code block passes the row's ``tests`` (batch.extras)."""
    tests = extras_field("code_tests", responses, batch, "tests", "rows of tests")
    with ThreadPoolExecutor(max_workers=max(1, min(len(responses), os.cpu_count() or 1))) as pool:
        return list(pool.map(_score, map(last_code_block, responses), tests))
