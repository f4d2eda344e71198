"""Each model family's own tool-call syntax, read from its chat template, and the conversation as it shows tools.

A model was trained on the format its chat template writes, and calls tools less reliably in a foreign one. The
family is read off the template text (what it writes for an assistant's calls):

- hermes: `<tool_call>\\n{"name": .., "arguments": ..}\\n</tool_call>` (Qwen2/2.5/3, Hermes, SmolLM3);
- llama: `{"name": .., "parameters": ..}` as the whole reply (Llama 3.1, 3.2, 3.3: the JSON its template renders for
  custom tools; `<|python_tag|>` is for its built-in tools, and is accepted before the JSON when read back);
- mistral: `[TOOL_CALLS][{"name": .., "arguments": ..}, ..]` (`[TOOL_CALLS]` one special token when the vocabulary
  has it), with 9-character call ids as its templates demand;
- generic: any other template. The tools are described in a system message of ours, and calls and results are
  written into the conversation as text, in the hermes syntax the grammar then enforces.

A native template renders `tools` and the calls and results itself (as transformers' apply_chat_template passes
them). Pure: template text (and the vocabulary's special tokens) in, a ToolSyntax out.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from shards.decoding.grammar import TOOL_CLOSE, TOOL_OPEN, CallSyntax

FAMILIES = ("generic", "hermes", "llama", "mistral")
MISTRAL_MARK = "[TOOL_CALLS]"


@dataclass(frozen=True)
class ToolSyntax:
    """How this model's prompt shows tools and how its replies write calls. Invariant: `generic` is the hermes
    call syntax with tools described by us; every other family's template renders tools itself."""

    family: str = "generic"
    marker_token: int | None = None  # mistral: the id of the one token [TOOL_CALLS]

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ValueError(f"unknown tool-call family {self.family!r}; one of {FAMILIES}")
        CallSyntax(self.call_family, self.marker_token)  # validates the marker

    @property
    def native(self) -> bool:
        return self.family != "generic"

    @property
    def call_family(self) -> str:
        """The family whose call syntax the grammar enforces and the reader reads."""
        return "hermes" if self.family == "generic" else self.family

    @property
    def call(self) -> CallSyntax:
        return CallSyntax(self.call_family, self.marker_token)

    @property
    def single_call(self) -> bool:
        """Llama's templates render one call per assistant turn (and refuse more): its replies hold one."""
        return self.family == "llama"


def template_family(template: str | None) -> str:
    """The family whose calls `template` writes (generic for a template that renders no tools)."""
    if not template or "tools" not in template:
        return "generic"
    if MISTRAL_MARK in template:
        return "mistral"
    if TOOL_OPEN in template:
        return "hermes"
    if "<|start_header_id|>" in template and '"parameters"' in template:
        return "llama"
    return "generic"


def tool_syntax(template: str | None, hf_tokenizer: Any = None) -> ToolSyntax:
    """The syntax of a model with chat template `template` and `tokenizers.Tokenizer` `hf_tokenizer` (which says
    whether [TOOL_CALLS] is one token)."""
    family = template_family(template)
    marker = None
    if family == "mistral" and hf_tokenizer is not None:
        marker = hf_tokenizer.token_to_id(MISTRAL_MARK)
    return ToolSyntax(family, marker)


def knows_tools(template: str | None) -> bool:
    """A chat template that renders `tools` and writes calls in a syntax of its own (not generic)."""
    return template_family(template) != "generic"


def call_text(name: str, arguments: Any) -> str:
    return f"{TOOL_OPEN}\n{json.dumps({'name': name, 'arguments': arguments}, ensure_ascii=False)}\n{TOOL_CLOSE}"


def generic_messages(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """The conversation for a template that knows no tools: `tools` (OpenAI tool objects, None when none may be
    called) described in the system message, calls and results written as text in the syntax the grammar
    enforces."""
    out: list[dict[str, Any]] = []
    for m in messages:
        if m["role"] == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{m['content']}\n</tool_response>"})
        elif m.get("tool_calls"):
            calls = "\n".join(call_text(c["function"]["name"], c["function"]["arguments"]) for c in m["tool_calls"])
            out.append({"role": "assistant", "content": (m["content"] + "\n" if m["content"] else "") + calls})
        else:
            out.append({"role": m["role"], "content": m["content"]})
    if tools:
        listing = "\n".join(json.dumps(t["function"], ensure_ascii=False) for t in tools)
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
