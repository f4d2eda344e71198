"""The one chat path's events (node/http/chat.py), which every API dialect folds into its own shapes: text
passes through, tool calls are split out of the text, and one Finished closes the reply, saying why."""

from node.http.chat import CallOut, ChatEvents, Finished, TextOut
from node.http.completion import TextDelta
from node.http.tools import Structure, Tool

ADD = Tool("add", "Add", {"type": "object", "properties": {"a": {"type": "integer"}}})


def feed(structure: Structure, *pieces: TextDelta) -> list:
    events = ChatEvents(structure)
    return [e for piece in pieces for e in events.feed(piece)]


def test_without_tools_every_piece_is_text_and_the_last_says_why_it_ended():
    out = feed(
        Structure(), TextDelta("Hel"), TextDelta("lo", finish_reason="stop", completion_tokens=2, stop_sequence="!")
    )
    assert out == [TextOut("Hel"), TextOut("lo"), Finished("stop", 2, "!")]


def test_a_call_is_split_out_of_the_text_and_a_reply_that_called_ends_as_tool_calls():
    call = '<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>'
    out = feed(Structure(tools=(ADD,)), TextDelta("Sure. "), TextDelta(call, finish_reason="stop", completion_tokens=9))
    texts = "".join(e.text for e in out if isinstance(e, TextOut))
    (called,) = [e for e in out if isinstance(e, CallOut)]
    assert texts.strip() == "Sure."
    assert (called.call.name, called.arguments) == ("add", {"a": 1})
    assert out[-1] == Finished("tool_calls", 9)


def test_a_reply_cut_at_max_tokens_stays_length_even_after_a_call():
    call = '<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>'
    out = feed(Structure(tools=(ADD,)), TextDelta(call), TextDelta("", finish_reason="length", completion_tokens=30))
    assert out[-1] == Finished("length", 30)
