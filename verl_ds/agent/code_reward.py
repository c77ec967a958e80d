"""The ``code_tests`` reward: the response's last fenced Python block runs in the sandbox, then the row's ``tests``
(statements, as MBPP's ``test_list`` or HumanEval's ``check``) in its namespace; 1.0 only when the harness saw the
last test finish, so an early exit of any kind scores 0. What assert-based tests cannot catch: docs/agents.md."""
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
