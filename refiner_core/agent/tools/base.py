"""The tool interface: a named tool takes parsed JSON arguments and returns a ToolResult.

Tools register in TOOLS by "module:factory" string, like the engines: only the tools a recipe enables are
imported. A tool's `run_many` executes all calls of one agent turn together (bounded concurrency is the tool's
business: the Python sandbox runs them in a thread pool).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from refiner_core.config import AgentConfig
from refiner_core.runtime.registry import resolve


@dataclass
class ToolResult:
    text: str  # what the model sees as the tool message
    status: str  # 'ok' | 'error' | 'timeout' | ... ; 'invalid_call' when the call never ran
    exit_code: int | None = None
    stdout: str = ""
    stderr: str = ""
    seconds: float = 0.0
    failure: str | None = None  # why the call could not run: 'bad_json: ...', 'unknown_tool: ...', ...


class Tool(Protocol):
    name: str
    description: str
    parameters: dict  # JSON schema of the arguments object
    max_seconds: float  # the most wall time one call can take (the loop reserves it against a conversation's budget)

    def run_many(self, arguments: list[dict]) -> list[ToolResult]: ...

    def close(self) -> None: ...


def tool_schema(tool: Tool) -> dict:
    """The function description a Hermes-style system prompt lists (and `apply_chat_template(tools=...)` takes)."""
    return {
        "type": "function",
        "function": {"name": tool.name, "description": tool.description, "parameters": tool.parameters},
    }


TOOLS: dict[str, str] = {"python": "refiner_core.agent.tools.python_sandbox:make_python_tool"}


def make_tool(name: str, settings: AgentConfig) -> Tool:
    return resolve(TOOLS, "tool", name)(settings)
