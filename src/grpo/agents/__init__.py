"""Agents: the pure parts of multi-turn tool-calling episodes (parsing calls, running tools, exact ids)."""

from grpo.agents.chat import ChatRenderer, ChatTemplateError
from grpo.agents.messages import assistant_message, call_id, tool_messages
from grpo.agents.parsing import (
    PARSERS,
    HermesParser,
    Llama3JsonParser,
    MistralParser,
    ParsedTurn,
    ToolCall,
    ToolCallParser,
    detect_parser,
)
from grpo.agents.tools import ERROR_KINDS, ToolBox, ToolResult, tool_schema

__all__ = [
    "ERROR_KINDS",
    "PARSERS",
    "ChatRenderer",
    "ChatTemplateError",
    "HermesParser",
    "Llama3JsonParser",
    "MistralParser",
    "ParsedTurn",
    "ToolBox",
    "ToolCall",
    "ToolCallParser",
    "ToolResult",
    "assistant_message",
    "call_id",
    "detect_parser",
    "tool_messages",
    "tool_schema",
]
