"""verl_ds.agent.tools: the call formats parsed from hand-written turns, every failure returned as a message, the
schemas a chat template takes, and the calc / python tools against hand-computed results."""
import json
import os

import pytest

from verl_ds.agent.tools import ToolCall, ToolSet, calc, parse_tool_calls, python, without_reasoning


def weather(city: str, days: int = 1) -> dict:
    """Forecast for a city.

    Args:
        city: The city's name.
        days: How many days ahead.
    """
    if city == "Atlantis":
        raise LookupError("no such city")
    return {"city": city, "days": days, "sky": "clear"}


def test_hermes_calls_between_text():
    turn = ('Let me check.\n<tool_call>\n{"name": "calc", "arguments": {"expression": "2+3"}}\n</tool_call>\n'
            '<tool_call>{"name": "weather", "arguments": "{\\"city\\": \\"Oslo\\"}"}</tool_call>')
    parsed = parse_tool_calls(turn, "hermes")
    assert parsed.content == "Let me check."
    assert parsed.calls == (ToolCall("calc", {"expression": "2+3"}, "call0"), ToolCall("weather", {"city": "Oslo"}, "call1"))
    assert parsed.errors == ()


def test_hermes_malformed_and_unclosed_calls_are_errors_not_exceptions():
    parsed = parse_tool_calls('<tool_call>{"name": "calc", "arguments": {"expression": }</tool_call>'
                              '<tool_call>["calc"]</tool_call> ok <tool_call>{"name": "calc"', "hermes")
    assert parsed.calls == () and parsed.content == "ok"
    assert len(parsed.errors) == 3
    assert "not valid JSON" in parsed.errors[0] and "must be an object" in parsed.errors[1]
    assert "not closed" in parsed.errors[2]


def test_llama3_json_and_plain_answers():
    parsed = parse_tool_calls('<|python_tag|>{"name": "weather", "parameters": {"city": "Rome", "days": 2}}',
                              "llama3_json")
    assert parsed.calls == (ToolCall("weather", {"city": "Rome", "days": 2}, "call0"),)
    assert parse_tool_calls("The answer is 5.", "llama3_json").calls == ()
    assert parse_tool_calls("{not json", "llama3_json").errors[0].startswith("tool call 0 is not valid JSON")


def test_mistral_list_of_calls():
    parsed = parse_tool_calls('Sure. [TOOL_CALLS][{"name": "calc", "arguments": {"expression": "7*6"}}, '
                              '{"name": "weather", "arguments": {"city": "Lima"}}]', "mistral")
    assert parsed.content == "Sure." and [c.name for c in parsed.calls] == ["calc", "weather"]
    assert parse_tool_calls("no call here", "mistral") == parse_tool_calls("no call here", "llama3_json")


DEEP, HUGE = "[" * 100_000 + "]" * 100_000, "9" * 5000


@pytest.mark.parametrize("turn, fmt", [
    ('<tool_call>{{"name": "calc", "arguments": {{"expression": {}}}}}</tool_call>', "hermes"),
    ('<tool_call>{{"name": "calc", "arguments": {}}}</tool_call>', "hermes"),
    ('<tool_call>{{"name": "calc", "arguments": "{{\\"expression\\": {}}}"}}</tool_call>', "hermes"),  # as a string
    ('<|python_tag|>{{"name": "calc", "parameters": {{"expression": {}}}}}', "llama3_json"),
    ('[{}]', "llama3_json"),
    ('[TOOL_CALLS][{{"name": "calc", "arguments": {{"expression": {}}}}}]', "mistral"),
    ('[TOOL_CALLS]{}', "mistral"),
], ids=["hermes", "hermes arguments", "hermes arguments string", "llama3_json", "llama3_json list", "mistral",
        "mistral list"])
@pytest.mark.parametrize("payload", [DEEP, HUGE], ids=["nested 100000 deep", "5000 digits"])
def test_json_too_deep_or_too_long_for_python_is_an_error_not_an_exception(turn, fmt, payload):
    """json.loads raises RecursionError / ValueError (not JSONDecodeError) on these: still the model's error."""
    parsed = parse_tool_calls(turn.format(payload), fmt)
    assert parsed.calls == () and len(parsed.errors) == 1, parsed.errors
    assert ("RecursionError" if payload is DEEP else "ValueError") in parsed.errors[0]


def test_unknown_format_is_named():
    with pytest.raises(ValueError, match="tool call format 'xml' is unknown; expected one of hermes"):
        parse_tool_calls("", "xml")


def test_schema_is_what_chat_templates_take():
    tools = ToolSet([calc, weather])
    assert tools.names == ["calc", "weather"]
    w = tools.schemas[1]["function"]
    assert w["name"] == "weather" and w["parameters"]["required"] == ["city"]
    assert w["parameters"]["properties"]["days"] == {"type": "integer", "description": "How many days ahead."}


@pytest.mark.parametrize("call, message", [
    (ToolCall("wether", {"city": "Oslo"}, "c"), "unknown tool 'wether' (did you mean 'weather'?); available: calc, weather"),
    (ToolCall("weather", {}, "c"), "missing argument 'city'"),
    (ToolCall("weather", {"city": "Oslo", "hours": 3}, "c"), "unknown argument 'hours' (expected: city, days)"),
    (ToolCall("weather", {"city": "Oslo", "days": "two"}, "c"), "argument 'days' must be integer, got str"),
    (ToolCall("weather", {"city": "Oslo", "days": True}, "c"), "argument 'days' must be integer, got bool"),
    (ToolCall("weather", {"city": "Atlantis"}, "c"), "raised LookupError: no such city"),
    (ToolCall("calc", {"expression": "1/0"}, "c"), "raised ZeroDivisionError"),
    (ToolCall("calc", {"expression": "__import__('os')"}, "c"), "only numbers"),
])
def test_failures_come_back_as_messages(call, message):
    result = ToolSet([calc, weather]).run(call)
    assert result.error is not None and message in result.error, result
    assert result.content == "Error: " + result.error and result.call_id == "c"


def test_results_are_text():
    result = ToolSet([weather]).run(ToolCall("weather", {"city": "Oslo", "days": 3}, "call0"))
    assert result.error is None and json.loads(result.content) == {"city": "Oslo", "days": 3, "sky": "clear"}


def test_a_tool_without_a_docstring_is_refused_by_name():
    def bare(x: int):
        return x
    with pytest.raises(ValueError, match="tool 'bare': no JSON schema"):
        ToolSet([bare])
    with pytest.raises(ValueError, match="given twice"):
        ToolSet([calc, calc])


@pytest.mark.parametrize("expression, expected", [
    ("37 * (12 + 5)", "629"), ("2 ** 10 - 1", "1023"), ("-7 // 2", "-4"), ("7 % 3", "1"), ("1 / 4", "0.25"),
    ("6 / 3", "2"), ("123456789 * 987654321", "121932631112635269"),
])
def test_calc_is_exact(expression, expected):
    assert calc(expression) == expected


@pytest.mark.parametrize("expression", ["2 ** 1000", "x + 1", "1 +", "a" * 201, "[1] * 3"])
def test_calc_refuses_what_is_not_small_arithmetic(expression):
    with pytest.raises(ValueError):
        calc(expression)


def test_python_tool_prints_or_reports():
    assert python("print(sum(i * i for i in range(10)))").strip() == "285"
    assert python("import sys\nsys.exit('no answer')") == "[error] no answer"
    assert python("open('/etc/evil', 'w')").startswith(("[refused]", "[error]")) and not os.path.exists("/etc/evil")


def test_without_reasoning_keeps_what_follows_the_last_think_block():
    assert without_reasoning("<think>\na\n</think>\n\n<think>b</think>\n\nThe answer.") == "The answer."
    assert without_reasoning("<think>\nstill thinking about <tool_call>{}</tool_call>") == ""  # never closed
    assert without_reasoning("  plain\n") == "  plain\n"
