"""Function calling on /v1/chat/completions without a tool-call parser, as vLLM does it: the call is a structured
output. `tool_choice` naming a function constrains the output to that function's `parameters` schema (the output is
the call's arguments); "required" constrains it to a JSON array of one or more `{"name", "parameters"}` calls to
the listed tools. "none" generates text. "auto" (the model decides whether to call) needs a parser for the model's
own tool-call syntax, which vLLM picks per model family (`--tool-call-parser`); SmolLM2's chat template has no tool
syntax, so "auto" with tools is refused.

Owns: checking `tools` / `tool_choice`, the constraint they make, and the `tool_calls` the output becomes.
Ignores: sampling, streaming and HTTP.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from lab.serve.errors import APIError

EMPTY_PARAMETERS = {"type": "object", "properties": {}}


@dataclass(frozen=True, slots=True)
class ToolChoice:
    """What the output must be: the arguments of `name` (a named function) or, with name None ("required"), a JSON
    array of calls. `schema` is the JSON schema the structured output follows."""

    name: str | None
    schema: dict[str, Any]

    @property
    def finish_reason(self) -> str:
        """OpenAI's: a forced named function ends with "stop"; calls the model chose end with "tool_calls"."""
        return "stop" if self.name is not None else "tool_calls"


def tool_choice_constraint(tools: list[dict[str, Any]] | None, tool_choice: str | dict[str, Any] | None
                           ) -> ToolChoice | None:
    """The request's tools and tool_choice -> the constraint (None: plain text), or a 400 naming the problem."""
    functions = _functions(tools or [])
    if tool_choice is None:
        tool_choice = "auto" if functions else "none"   # NOTE: OpenAI's default
    if tool_choice == "none" or (tool_choice == "auto" and not functions):
        return None
    if not functions:
        raise APIError(400, f"tool_choice={tool_choice!r} needs tools", param="tool_choice")
    if tool_choice == "auto":
        raise APIError(400, "tool_choice \"auto\" needs a parser for the model's own tool-call syntax, which this "
                       "server does not have; send tool_choice \"required\" or name a function", param="tool_choice")
    if tool_choice == "required":
        calls = [{"type": "object", "properties": {"name": {"type": "string", "enum": [name]}, "parameters": schema},
                  "required": ["name", "parameters"], "additionalProperties": False}
                 for name, schema in functions.items()]
        return ToolChoice(None, {"type": "array", "minItems": 1, "items": {"anyOf": calls}})
    name = (tool_choice.get("function") or {}).get("name") if isinstance(tool_choice, dict) else None
    if not isinstance(tool_choice, dict) or tool_choice.get("type") != "function" or not isinstance(name, str):
        raise APIError(400, f"tool_choice must be \"none\", \"auto\", \"required\" or {{\"type\": \"function\", "
                       f"\"function\": {{\"name\": ...}}}}, got {tool_choice!r}", param="tool_choice")
    if name not in functions:
        raise APIError(400, f"tool_choice names function {name!r}, which is not among the tools "
                       f"({', '.join(functions)})", param="tool_choice")
    return ToolChoice(name, functions[name])


def _functions(tools: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """OpenAI's tools -> {function name: its parameters' JSON schema}."""
    functions: dict[str, dict[str, Any]] = {}
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        name = function.get("name") if isinstance(function, dict) else None
        if tool.get("type") != "function" or not isinstance(name, str) or not name:
            raise APIError(400, f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\": ..., "
                           f"\"parameters\": {{...}}}}}}", param="tools")
        parameters = function.get("parameters") or EMPTY_PARAMETERS
        if not isinstance(parameters, dict):
            raise APIError(400, f"tools[{i}].function.parameters must be a JSON schema object", param="tools")
        if name in functions:
            raise APIError(400, f"tools name function {name!r} twice", param="tools")
        functions[name] = parameters
    return functions


def tool_calls(choice: ToolChoice, text: str) -> list[dict[str, Any]] | None:
    """The output as OpenAI's `tool_calls` (None: it is not a complete call, e.g. cut at max_tokens)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return None
    if choice.name is not None:
        calls = [(choice.name, value)]
    else:
        calls = [(call["name"], call["parameters"]) for call in value]
    return [{"id": f"chatcmpl-tool-{uuid.uuid4().hex}", "type": "function",
             "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}}
            for name, arguments in calls]
