"""Tools and structured output on the OpenAI API: `tools`, `tool_choice`, `parallel_tool_calls`,
`response_format`, tool messages in the conversation, and tool calls read back out of the model's text.

Tool calls are written Hermes/Qwen style, `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`: a chat
template that knows that format (Qwen2/2.5/3) renders the tools itself; any other model is told about the tools in
a system message of ours (`generic_messages`). Either way the reply's calls are constrained by a grammar
(shards/decoding/grammar.py): under "required" or a named function the reply is calls only; under "auto" the model writes
free text and the grammar takes over once it starts a call. Everything here is pure: parsing, rendering, and the
`ToolCallParser` that splits the generated text into content and calls as it streams.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from shards.decoding.grammar import (
    TOOL_CLOSE,
    TOOL_OPEN,
    GrammarError,
    json_object_grammar,
    json_schema_grammar,
    tool_call_grammar,
)

MAX_TOOLS = 128
MAX_SCHEMA_BYTES = 64 * 1024
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
    parallel: bool = False
    json_schema: dict[str, Any] | None = None  # response_format json_schema / json_object ({"type": "object"})

    @property
    def calls_tools(self) -> bool:
        return bool(self.tools) and self.tool_choice != "none"

    def grammar(self) -> str | None:
        """The llguidance grammar the reply must follow, or None (raises ToolError for a schema it can't use)."""
        try:
            if self.json_schema is not None:
                return (
                    json_object_grammar()
                    if self.json_schema == {"type": "object"}
                    else json_schema_grammar(self.json_schema)
                )
            if not self.calls_tools:
                return None
            named = self.tool_choice not in ("auto", "required")
            tools = [(t.name, t.parameters) for t in self.tools if not named or t.name == self.tool_choice]
            return tool_call_grammar(tools, required=self.tool_choice != "auto", parallel=self.parallel)
        except GrammarError as e:
            raise ToolError(self.param, str(e)) from None

    @property
    def param(self) -> str:
        return "response_format" if self.json_schema is not None else "tools"


# -- parsing the request ----------------------------------------------------------------------------------------
def _schema(value: Any, param: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ToolError(param, f"'{param}' must be a JSON Schema object")
    if len(json.dumps(value)) > MAX_SCHEMA_BYTES:
        raise ToolError(param, f"'{param}' exceeds {MAX_SCHEMA_BYTES} bytes")
    return value


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
    # One call per reply unless asked (as llama-server): a small model under "required" repeats calls until
    # max_tokens when the grammar lets it.
    parallel = body.get("parallel_tool_calls", False)
    if not isinstance(parallel, bool):
        raise ToolError("parallel_tool_calls", "'parallel_tool_calls' must be a boolean")
    schema = _response_format(body.get("response_format"))
    if schema is not None and tools and choice != "none":
        raise ToolError("response_format", "a JSON response_format together with tools is not supported")
    return Structure(tools, choice, parallel, schema)


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
def knows_tools(template: str | None) -> bool:
    """A chat template that renders `tools` and writes calls as <tool_call> blocks (Hermes, Qwen)."""
    return template is not None and "tools" in template and TOOL_OPEN in template


def call_text(name: str, arguments: Any) -> str:
    return f"{TOOL_OPEN}\n{json.dumps({'name': name, 'arguments': arguments}, ensure_ascii=False)}\n{TOOL_CLOSE}"


def generic_messages(messages: list[dict[str, Any]], structure: Structure) -> list[dict[str, Any]]:
    """The conversation for a template that knows no tools: the tools described in the system message, calls and
    results written as text in the same format the grammar enforces."""
    out: list[dict[str, Any]] = []
    for m in messages:
        if m["role"] == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{m['content']}\n</tool_response>"})
        elif m.get("tool_calls"):
            calls = "\n".join(call_text(c["function"]["name"], c["function"]["arguments"]) for c in m["tool_calls"])
            out.append({"role": "assistant", "content": (m["content"] + "\n" if m["content"] else "") + calls})
        else:
            out.append({"role": m["role"], "content": m["content"]})
    if structure.calls_tools:
        listing = "\n".join(json.dumps(t.openai()["function"], ensure_ascii=False) for t in structure.tools)
        prompt = (
            "You can call these tools:\n"
            + listing
            + "\nTo call a tool, reply with "
            + TOOL_OPEN
            + '\n{"name": <tool name>, "arguments": <arguments object>}\n'
            + TOOL_CLOSE
            + "\nTool results come back in <tool_response> blocks."
        )
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + prompt}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out


# -- reading calls back out of the text -------------------------------------------------------------------------
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
    """Splits the streamed reply into content and tool calls. Content before the first `<tool_call>` is released
    as it comes, less any tail that may be the start of `<tool_call>`; a call is released once its
    `</tool_call>` arrives. Text that never became a valid call is released as content at the end."""

    def __init__(self) -> None:
        self.buffer, self.in_calls, self.calls, self.broken = "", False, 0, False

    def feed(self, text: str, final: bool = False) -> tuple[str, list[ToolCall]]:
        if self.broken:
            return text, []
        self.buffer += text
        content, calls = "", []
        if not self.in_calls:
            at = self.buffer.find(TOOL_OPEN)
            if at < 0:
                # held back: a possible start of <tool_call>, and the whitespace before it (not the content's)
                cut = (
                    len(self.buffer)
                    if final
                    else len(self.buffer[: len(self.buffer) - _partial(self.buffer, TOOL_OPEN)].rstrip("\n "))
                )
                content, self.buffer = self.buffer[:cut], self.buffer[cut:]
                return content, []
            content, self.buffer, self.in_calls = self.buffer[:at].rstrip("\n "), self.buffer[at:], True
        while (end := self.buffer.find(TOOL_CLOSE)) >= 0:
            block, self.buffer = self.buffer[:end], self.buffer[end + len(TOOL_CLOSE) :].lstrip("\n ")
            call = self._call(block.strip().removeprefix(TOOL_OPEN))
            if call is None:  # not a call after all: the rest is plain text
                self.broken, rest, self.buffer = True, block + TOOL_CLOSE + self.buffer, ""
                return content + rest, calls
            calls.append(call)
        if final and self.buffer.strip():
            content, self.buffer = content + self.buffer, ""  # an unfinished call (max_tokens): left as text
        return content, calls

    def _call(self, text: str) -> ToolCall | None:
        try:
            body = json.loads(text)
        except ValueError:
            return None
        if not isinstance(body, dict) or not isinstance(body.get("name"), str):
            return None
        call = ToolCall(
            self.calls,
            f"call_{uuid.uuid4().hex[:24]}",
            body["name"],
            json.dumps(body.get("arguments", {}), ensure_ascii=False),
        )
        self.calls += 1
        return call


def _partial(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker`."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


def prompt_inputs(
    messages: list[dict[str, Any]], structure: Structure, template: str | None
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """The messages (and `tools`, for a template that renders them) to give the chat template."""
    if knows_tools(template):
        return messages, [t.openai() for t in structure.tools] if structure.calls_tools else None
    return generic_messages(messages, structure), None
