"""Tools a model may call: a JSON schema per Python callable (``transformers.utils.get_json_schema``), the parsing of
tool calls and their execution; every failure becomes a message for the model, never an exception in the trainer.

Formats: ``hermes`` (Hermes, Qwen2.5, Qwen3: ``<tool_call>{...}</tool_call>``), ``llama3_json`` (Llama 3.1-3.3: the
whole turn, perhaps after ``<|python_tag|>``), ``mistral`` (``[TOOL_CALLS][...]``); docs/agents.md, "Tools"."""
from __future__ import annotations

import ast
import difflib
import json
import operator
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

from verl_ds.agent.sandbox import SandboxLimits, run_python

__all__ = ["ToolCall", "ParsedTurn", "ToolResult", "ToolSet", "parse_tool_calls", "without_reasoning",
           "TOOL_CALL_FORMATS", "calc", "python"]

TOOL_CALL_FORMATS = ("hermes", "llama3_json", "mistral")
_HERMES = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict
    id: str


@dataclass(frozen=True)
class ParsedTurn:
    """A model turn split into its text ``content``, the well-formed ``calls`` and one message per malformed call."""
    content: str
    calls: tuple = ()
    errors: tuple = ()


@dataclass(frozen=True)
class ToolResult:
    """What goes back to the model as a tool message; ``error`` is set when the call failed."""
    name: str
    content: str
    error: str | None = None
    call_id: str = ""


def without_reasoning(turn: str) -> str:
    """The text after the last ``</think>`` (Qwen3's split; none if it never closes): reasoning is not the answer."""
    if "</think>" in turn:
        return turn.rsplit("</think>", 1)[1].lstrip("\n")
    return "" if turn.lstrip().startswith("<think>") else turn


def parse_tool_calls(text: str, fmt: str = "hermes") -> ParsedTurn:
    """The tool calls in one model turn, in the model family's format (TOOL_CALL_FORMATS)."""
    if fmt == "hermes":
        bodies = [m.group(1) for m in _HERMES.finditer(text)]
        content = _HERMES.sub("", text)
        unclosed = []
        if "<tool_call>" in content:  # opened and never closed: the turn ended (or was cut) inside a call
            content = content[:content.index("<tool_call>")]
            unclosed.append("a <tool_call> was opened but not closed with </tool_call>")
        turn = _calls(bodies, "arguments", content.strip(), [])
        return ParsedTurn(turn.content, turn.calls, turn.errors + tuple(unclosed))
    if fmt == "llama3_json":
        body = text.strip().removeprefix("<|python_tag|>").strip()
        if not body.startswith(("{", "[")):
            return ParsedTurn(text.strip())
        return _calls(_json_list(body), "parameters", "", [])
    if fmt == "mistral":
        if "[TOOL_CALLS]" not in text:
            return ParsedTurn(text.strip())
        content, body = text.split("[TOOL_CALLS]", 1)
        return _calls(_json_list(body.strip()), "arguments", content.strip(), [])
    raise ValueError(f"tool call format {fmt!r} is unknown; expected one of {', '.join(TOOL_CALL_FORMATS)}")


def _loads(text: str):
    """JSON -> (value, "") or (None, why); deep nesting and huge integers in model output are its errors, not ours."""
    try:
        return json.loads(text), ""
    except json.JSONDecodeError as e:
        return None, f"{e.msg} at character {e.pos}"
    except (ValueError, RecursionError) as e:
        return None, f"{type(e).__name__}: {str(e)[:120]}"


def _json_list(body: str) -> list:
    """A JSON list body -> its items re-encoded one by one (so each is judged alone); anything else -> [body]."""
    value, error = _loads(body)
    if error or not isinstance(value, list):
        return [body]
    try:
        return [json.dumps(v) for v in value]
    except (ValueError, RecursionError):  # an item nested too deep to write back: judged (and refused) as a whole
        return [body]


def _calls(bodies: list, args_key: str, content: str, errors: list) -> ParsedTurn:
    calls = []
    for i, body in enumerate(bodies):
        value, error = _loads(body)
        if error:
            errors.append(f"tool call {i} is not valid JSON ({error}): {body.strip()[:200]}")
            continue
        args = value.get(args_key, value.get("arguments", {})) if isinstance(value, dict) else None
        if isinstance(args, str):  # some models send the arguments as a JSON string
            args, error = _loads(args)
            if error:
                errors.append(f"tool call {i}'s arguments are a string that is not valid JSON ({error})")
                continue
        if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not isinstance(args, dict):
            errors.append(f"tool call {i} must be an object with a string \"name\" and an object \"{args_key}\", "
                          f"got: {body.strip()[:200]}")
            continue
        calls.append(ToolCall(value["name"], args, f"call{len(calls)}"))
    return ParsedTurn(content, tuple(calls), tuple(errors))


_JSON_TYPES = {"string": (str,), "integer": (int,), "number": (int, float), "boolean": (bool,), "array": (list,),
               "object": (dict,), "null": (type(None),)}


def _argument_errors(schema: dict, args: dict) -> list[str]:
    params = schema["function"].get("parameters") or {}
    props, required = params.get("properties", {}), params.get("required", [])
    errors = [f"missing argument {k!r}" for k in required if k not in args]
    for key, value in args.items():
        if key not in props:
            errors.append(f"unknown argument {key!r} (expected: {', '.join(props) or 'none'})")
            continue
        kinds = props[key].get("type")
        kinds = [kinds] if isinstance(kinds, str) else kinds or []
        allowed = tuple(t for k in kinds for t in _JSON_TYPES.get(k, (object,)))
        is_bool = isinstance(value, bool)
        if allowed and (not isinstance(value, allowed) or (is_bool and bool not in allowed)):
            errors.append(f"argument {key!r} must be {' or '.join(kinds)}, got {type(value).__name__} {value!r:.60}")
        elif "enum" in props[key] and value not in props[key]["enum"]:
            errors.append(f"argument {key!r} must be one of {props[key]['enum']}, got {value!r:.60}")
    return errors


@dataclass
class ToolSet:
    """Named tools: ``schemas`` for the chat template, ``run(call)`` to execute one call safely."""
    tools: Iterable[Callable] = ()
    schemas: list = field(init=False)
    _fns: dict = field(init=False, repr=False)

    def __post_init__(self):
        from transformers.utils import get_json_schema

        self._fns, self.schemas = {}, []
        for fn in self.tools:
            try:
                schema = get_json_schema(fn)
            except Exception as e:  # transformers raises its own types for missing docstrings / type hints
                raise ValueError(f"tool {getattr(fn, '__name__', fn)!r}: no JSON schema can be built from its "
                                 f"signature and docstring ({e}); give every argument a type hint and a Google-style "
                                 f"'Args:' entry") from e
            name = schema["function"]["name"]
            if name in self._fns:
                raise ValueError(f"tool name {name!r} is given twice")
            self._fns[name] = fn
            self.schemas.append(schema)
        self.tools = tuple(self._fns.values())

    @property
    def names(self) -> list[str]:
        return list(self._fns)

    def run(self, call: ToolCall) -> ToolResult:
        """Execute ``call``; an unknown tool, wrong arguments or an exception come back as the result's error."""
        if call.name not in self._fns:
            close = difflib.get_close_matches(call.name, self._fns, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            return self._error(call, f"unknown tool {call.name!r}{hint}; available: {', '.join(self._fns) or 'none'}")
        schema = next(s for s in self.schemas if s["function"]["name"] == call.name)
        problems = _argument_errors(schema, call.arguments)
        if problems:
            return self._error(call, f"tool {call.name!r}: " + "; ".join(problems))
        try:
            out = self._fns[call.name](**call.arguments)
        except Exception as e:  # the model's call failed, not the trainer: it reads the error and may retry
            return self._error(call, f"tool {call.name!r} raised {type(e).__name__}: {e}")
        content = out if isinstance(out, str) else json.dumps(out, default=str)
        return ToolResult(call.name, content, None, call.id)

    @staticmethod
    def _error(call: ToolCall, message: str) -> ToolResult:
        return ToolResult(call.name, f"Error: {message}", message, call.id)


_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.USub: operator.neg, ast.UAdd: operator.pos}


def _evaluate(node: ast.AST) -> Any:
    if isinstance(node, ast.Expression):
        return _evaluate(node.body)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and (abs(right) > 64 or abs(left) > 1e6):
            raise ValueError("exponent or base too large (at most 64 and 1e6)")
        return _BINARY[type(node.op)](left, right)
    raise ValueError(f"only numbers, + - * / // % ** and parentheses are allowed, got {ast.dump(node)[:60]}")


# calc's and python's docstrings are their descriptions in the tool schema the model reads
def calc(expression: str) -> str:
    """Evaluate an arithmetic expression exactly (integers stay integers).

    Args:
        expression: The expression, with numbers, + - * / // % ** and parentheses, e.g. "37 * (12 + 5)".
    """
    if len(expression) > 200:
        raise ValueError(f"expression too long ({len(expression)} characters, at most 200)")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as e:
        raise ValueError(f"not an arithmetic expression: {e.msg}") from None
    value = _evaluate(tree)
    return str(int(value) if isinstance(value, float) and value.is_integer() and abs(value) < 2**53 else value)


def python(code: str) -> str:
    """Run Python (standard library only) isolated: no network, no files but its own directory, 10 s; print results.

    Args:
        code: The program; what it prints is the result.
    """
    return run_python(code, SandboxLimits(timeout_s=10, cpu_s=10, memory_mb=512)).summary()
