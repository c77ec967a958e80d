"""Multi-turn rollouts with tools and environments: environments, tools, the sandbox (docs/agents.md)."""
from verl_ds.agent.env import ENVIRONMENTS, Environment, Step, ToolEnvironment, register_environment
from verl_ds.agent.registry import make_environment
from verl_ds.agent.sandbox import SandboxLimits, SandboxResult, run_python
from verl_ds.agent.tools import ToolCall, ToolSet, parse_tool_calls

__all__ = ["ENVIRONMENTS", "Environment", "Step", "ToolEnvironment", "make_environment", "register_environment",
           "SandboxLimits", "SandboxResult", "run_python", "ToolCall", "ToolSet", "parse_tool_calls"]
