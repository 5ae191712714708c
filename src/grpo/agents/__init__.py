"""Agents: the pure parts of multi-turn tool-calling episodes (parsing calls, running tools, exact ids)."""

from grpo.agents.chat import ChatRenderer, ChatTemplateError
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
from grpo.agents.tools import ToolBox, ToolResult, tool_schema

__all__ = [
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
    "detect_parser",
    "tool_schema",
]
