"""Tools and structured output on the OpenAI API: `tools`, `tool_choice`, `parallel_tool_calls`,
`response_format`, tool messages in the conversation, and tool calls read back out of the model's text.

Calls are written in the model family's own syntax (node/http/tool_syntax.py: Hermes/Qwen `<tool_call>` blocks,
Llama 3.1+ JSON, Mistral `[TOOL_CALLS]`), read off its chat template; a template that renders tools gets them and
the conversation as they are, any other model is told about the tools in a system message of ours. Either way the
reply's calls are constrained by a grammar (shards/decoding/grammar.py): under "required" or a named function the
reply is calls only; under "auto" it is free text (or, with a JSON response_format, JSON of that schema) or calls.
Calls are read back as they stream (node/http/tool_stream.py). Everything here is pure.
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass
from typing import Any

from node.http.tool_stream import CallDelta, CallStream
from node.http.tool_syntax import ToolSyntax, generic_messages, knows_tools, template_family, tool_syntax
from shards.decoding.grammar import (
    GrammarError,
    json_object_grammar,
    json_schema_grammar,
    schema_problem,
    tool_call_grammar,
)

__all__ = ["CallDelta", "CallStream", "ToolSyntax", "generic_messages", "knows_tools", "template_family"]

MAX_TOOLS = 128
MAX_SCHEMA_BYTES = 64 * 1024
MAX_SCHEMA_DEPTH = 128  # nested objects and arrays; real schemas stay within a few dozen
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_EMPTY_PARAMS = {"type": "object", "properties": {}}


class ToolError(ValueError):
    """A bad tools / tool_choice / response_format / message field: `param` names it (a 400)."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict[str, Any]

    def openai(self) -> dict[str, Any]:
        """The tool as chat templates expect it (the OpenAI request shape)."""
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.parameters},
        }


@dataclass(frozen=True)
class Structure:
    """What a request asks of its output's shape: tools (and which may be called), or a JSON schema."""

    tools: tuple[Tool, ...] = ()
    tool_choice: str = "auto"  # none | auto | required | the name of one tool
    parallel: bool = True
    json_schema: dict[str, Any] | None = None  # response_format json_schema / json_object ({"type": "object"})
    syntax: ToolSyntax = ToolSyntax()  # the serving model's (with_tool_syntax); generic until it is known

    @property
    def calls_tools(self) -> bool:
        return bool(self.tools) and self.tool_choice != "none"

    def grammar(self) -> str | None:
        """The llguidance grammar the reply must follow, or None (raises ToolError for a schema it can't use).
        With tools and a JSON response_format under "auto", the reply is calls or JSON of that schema."""
        try:
            if not self.calls_tools:
                if self.json_schema is None:
                    return None
                return (
                    json_object_grammar()
                    if self.json_schema == {"type": "object"}
                    else json_schema_grammar(self.json_schema)
                )
            named = self.tool_choice not in ("auto", "required")
            tools = [(t.name, t.parameters) for t in self.tools if not named or t.name == self.tool_choice]
            for name, params in tools:  # each alone first: its error then names its own pointers
                if problem := schema_problem(params):
                    raise ToolError("tools", f"the parameters of tool {name!r}: {problem}")
            if self.json_schema is not None and (problem := schema_problem(self.json_schema)):
                raise ToolError("tools", f"response_format's schema: {problem}")
            return tool_call_grammar(
                tools,
                required=self.tool_choice != "auto",
                parallel=self.parallel and not self.syntax.single_call,
                syntax=self.syntax.call,
                reply_schema=self.json_schema,
            )
        except GrammarError as e:
            raise ToolError(self.param, str(e)) from None
        except RecursionError:
            raise ToolError(self.param, "the schema is nested too deeply; flatten it (use $defs)") from None

    @property
    def param(self) -> str:
        return "tools" if self.calls_tools or self.json_schema is None else "response_format"


# -- parsing the request ----------------------------------------------------------------------------------------
def _schema(value: Any, param: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ToolError(param, f"'{param}' must be a JSON Schema object")
    if _depth(value) > MAX_SCHEMA_DEPTH:
        raise ToolError(
            param, f"'{param}' is nested too deeply (over {MAX_SCHEMA_DEPTH} levels); flatten it (use $defs)"
        )
    if len(json.dumps(value)) > MAX_SCHEMA_BYTES:
        raise ToolError(param, f"'{param}' exceeds {MAX_SCHEMA_BYTES} bytes")
    return value


def _depth(value: Any) -> int:
    """How deeply objects and arrays nest in `value`, walked without recursion: the interpreter's recursion limit,
    which other libraries raise, must not decide whether a schema is refused."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict | list):
            deepest = max(deepest, depth)
            if depth <= MAX_SCHEMA_DEPTH:
                stack.extend((v, depth + 1) for v in (item.values() if isinstance(item, dict) else item))
    return deepest


def parse_tools(body: dict[str, Any]) -> tuple[Tool, ...]:
    tools = body.get("tools")
    if tools is None:
        return ()
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise ToolError("tools", f"'tools' must be an array of at most {MAX_TOOLS} tools")
    out: list[Tool] = []
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(fn, dict):
            raise ToolError(f"tools[{i}]", 'each tool must be {"type": "function", "function": {...}}')
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise ToolError(f"tools[{i}].function.name", "a tool name must be 1-64 characters of [A-Za-z0-9_-]")
        if any(t.name == name for t in out):
            raise ToolError(f"tools[{i}].function.name", f"two tools are named {name!r}")
        description = fn.get("description", "")
        if not isinstance(description, str):
            raise ToolError(f"tools[{i}].function.description", "a tool description must be a string")
        params = fn.get("parameters", _EMPTY_PARAMS)
        out.append(Tool(name, description, _schema(params, f"tools[{i}].function.parameters")))
    return tuple(out)


def parse_structure(body: dict[str, Any], chat: bool) -> Structure:
    """The request's tools, tool_choice, parallel_tool_calls and response_format, checked against each other."""
    tools = parse_tools(body) if chat else ()
    if not chat and body.get("tools"):
        raise ToolError("tools", "tools are only supported on /v1/chat/completions")
    if body.get("functions") or body.get("function_call"):
        raise ToolError("functions", "the deprecated 'functions' is not supported; use 'tools'")
    choice = body.get("tool_choice")
    if choice is None:
        choice = "auto"
    elif isinstance(choice, dict):
        fn = choice.get("function")
        if choice.get("type") != "function" or not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ToolError(
                "tool_choice",
                '\'tool_choice\' must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}}',
            )
        choice = fn["name"]
        if choice not in {t.name for t in tools}:
            raise ToolError("tool_choice", f"tool_choice names {choice!r}, which is not one of the tools")
    elif choice not in ("none", "auto", "required"):
        raise ToolError("tool_choice", '\'tool_choice\' must be "none", "auto", "required" or a named function')
    if body.get("tool_choice") is not None and not tools:
        raise ToolError("tool_choice", "'tool_choice' is only allowed when 'tools' are given")
    parallel = body.get("parallel_tool_calls", True)  # OpenAI's default: several calls unless false
    if not isinstance(parallel, bool):
        raise ToolError("parallel_tool_calls", "'parallel_tool_calls' must be a boolean")
    return Structure(tools, choice, parallel, _response_format(body.get("response_format")))


def with_tool_syntax(req: Any, tokenizer: Any) -> Any:
    """`req` (a ChatRequest) with its structure in the tool-call syntax of the model `tokenizer` belongs to (its
    chat template's, see node/http/tool_syntax.py)."""
    structure = req.options.structure
    if not structure.calls_tools:
        return req
    syntax = tool_syntax(tokenizer.chat_template, getattr(tokenizer, "hf", None))
    options = dataclasses.replace(req.options, structure=dataclasses.replace(structure, syntax=syntax))
    return dataclasses.replace(req, options=options)


def _response_format(fmt: Any) -> dict[str, Any] | None:
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "object"}
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec:
            raise ToolError("response_format.json_schema", 'json_schema needs {"name": ..., "schema": {...}}')
        if not isinstance(spec.get("strict", False), bool):
            raise ToolError("response_format.json_schema.strict", "'strict' must be a boolean")
        return _schema(spec["schema"], "response_format.json_schema.schema")
    raise ToolError("response_format", 'response_format type must be "text", "json_object" or "json_schema"')


def parse_tool_calls(value: Any, i: int) -> list[dict[str, Any]]:
    """An assistant message's tool_calls, with arguments decoded (templates expect objects)."""
    if not isinstance(value, list) or not value:
        raise ToolError(f"messages[{i}].tool_calls", "tool_calls must be a non-empty array")
    calls = []
    for j, call in enumerate(value):
        fn = call.get("function") if isinstance(call, dict) else None
        where = f"messages[{i}].tool_calls[{j}]"
        if not isinstance(fn, dict) or not isinstance(call.get("id"), str) or not isinstance(fn.get("name"), str):
            raise ToolError(where, 'a tool call needs "id" and "function": {"name", "arguments"}')
        try:
            arguments = json.loads(fn.get("arguments") or "{}")
        except (TypeError, ValueError):
            raise ToolError(f"{where}.function.arguments", "arguments must be a JSON string") from None
        calls.append({"id": call["id"], "type": "function", "function": {"name": fn["name"], "arguments": arguments}})
    return calls


def check_tool_messages(messages: list[dict[str, Any]]) -> None:
    """Every tool message answers a call some earlier assistant message made."""
    ids: set[str] = set()
    for i, m in enumerate(messages):
        ids.update(c["id"] for c in m.get("tool_calls", ()))
        if m["role"] == "tool" and m["tool_call_id"] not in ids:
            raise ToolError(
                f"messages[{i}].tool_call_id",
                f"tool message answers {m['tool_call_id']!r}, which no earlier assistant message called",
            )


# -- rendering --------------------------------------------------------------------------------------------------
def prompt_inputs(
    messages: list[dict[str, Any]], structure: Structure, template: str | None
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """The messages (and `tools`, for a template that renders them) to give the chat template. A template renders
    the tools itself only when its calls are in the syntax the grammar enforces (`structure.syntax`, see
    with_tool_syntax): the prompt never shows one syntax and the grammar ask for another."""
    tools = [t.openai() for t in structure.tools] if structure.calls_tools else None
    if knows_tools(template) and tool_syntax(template).call_family == structure.syntax.call_family:
        return messages, tools
    return generic_messages(messages, tools), None


# -- whole calls read back out of the text ----------------------------------------------------------------------
@dataclass(frozen=True)
class ToolCall:
    index: int
    id: str
    name: str
    arguments: str  # a JSON string, as OpenAI sends it

    def openai(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


class ToolCallParser:
    """Splits the streamed reply into content and whole tool calls (for dialects that send a call in one piece):
    a call is released once its arguments are complete. A call cut short (max_tokens) is released as content."""

    def __init__(self, family: str = "hermes"):
        self.stream, self.open = CallStream(family), {}

    def feed(self, text: str, final: bool = False) -> tuple[str, list[ToolCall]]:
        content, deltas = self.stream.feed(text, final)
        for d in deltas:
            if d.id is not None:
                self.open[d.index] = ToolCall(d.index, d.id, d.name, "")
            else:
                call = self.open[d.index]
                self.open[d.index] = dataclasses.replace(call, arguments=call.arguments + d.arguments)
        calls = []
        for index in sorted(i for i in self.open if i < self.stream.calls or final):
            call = self.open.pop(index)
            try:
                json.loads(call.arguments)
                calls.append(call)
            except ValueError:
                content += json.dumps({"name": call.name, "arguments": ""})[:-3] + call.arguments
        return content, calls
