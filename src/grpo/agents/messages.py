"""The chat messages of a tool turn: the assistant message a parsed turn becomes, and its tool messages.

Chat templates render an assistant turn's calls from ``tool_calls`` (not from the text), and some check that
each tool message answers a call id (Mistral's want 9 alphanumeric characters). These helpers give both sides
the same ids, so that ``ChatRenderer.injected_ids(history + [assistant], tools)`` renders what the model saw.
"""

from __future__ import annotations

from grpo.agents.parsing import ParsedTurn, ToolCall
from grpo.agents.tools import ToolResult, call_slots


def call_id(turn: int, index: int) -> str:
    """A 9-character id for call attempt `index` of assistant turn `turn`, unique in an episode."""
    if not (0 <= turn < 10_000 and 0 <= index < 100_000):
        raise ValueError(f"call_id takes turn < 10000 and index < 100000, got turn={turn}, index={index}.")
    return f"{turn:04d}{index:05d}"


def assistant_message(turn: ParsedTurn, turn_index: int) -> dict:
    """The assistant message for a parsed turn: its text, and its well-formed calls as ``tool_calls``."""
    message: dict = {"role": "assistant", "content": turn.content}
    if turn.calls:
        ids = _call_ids(turn, turn_index)
        message["tool_calls"] = [
            {"type": "function", "id": ids[k], "function": {"name": call.name, "arguments": call.arguments}}
            for k, call in enumerate(turn.calls)
        ]
    return message


def tool_messages(turn: ParsedTurn, results: list[ToolResult], turn_index: int) -> list[dict]:
    """One tool message per result of `turn` (``ToolBox.run``'s list for it), in the order the model wrote the
    calls; a malformed call's message answers an id of its own, as no call in ``tool_calls`` has it."""
    ids = iter(_call_ids(turn, turn_index))
    messages = []
    for k, result in enumerate(results):
        name = result.call.name if result.call is not None else "invalid_tool_call"
        answered = next(ids) if result.call is not None else call_id(turn_index, k)
        messages.append({"role": "tool", "tool_call_id": answered, "name": name, "content": result.content})
    return messages


def _call_ids(turn: ParsedTurn, turn_index: int) -> list[str]:
    """The ids of the turn's well-formed calls: by position, or the model's own where it wrote one of the
    9 alphanumeric characters Mistral's templates accept (Mistral Small 3.2 writes [CALL_ID])."""
    ids = []
    for k, item in enumerate(call_slots(turn)):
        if isinstance(item, ToolCall):
            own = item.id is not None and len(item.id) == 9 and item.id.isalnum()
            ids.append(item.id if own else call_id(turn_index, k))
    return ids
