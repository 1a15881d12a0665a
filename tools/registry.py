"""The tool registry: schemas, toolsets, availability, and the deterministic list of all tools.

Tool modules are imported lazily (only when a session needs tools) so `--list_distributions` and
the CLI's validation stay fast. Each tool module exposes `TOOLS: list[ToolSpec]`.
"""

from __future__ import annotations

import hashlib
import importlib
import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Awaitable, Callable

if TYPE_CHECKING:
    from tools.environments.base import Environment
    from tools.settings import ToolSettings

# Toolset -> tools, fixed by the reference (tool_interfaces.md). Static so that validation,
# normalisation and the merge filter never depend on what happened to import.
TOOLSETS: dict[str, tuple[str, ...]] = {
    "terminal": ("terminal", "process"),
    "file": ("read_file", "write_file", "patch", "search_files"),
    "web": ("web_search", "web_extract"),
    "browser": (
        "browser_navigate",
        "browser_snapshot",
        "browser_click",
        "browser_type",
        "browser_scroll",
        "browser_back",
        "browser_press",
        "browser_close",
        "browser_get_images",
        "browser_vision",
        "browser_console",
    ),
    "vision": ("vision_analyze",),
    "image_gen": ("image_generate",),
    "moa": ("mixture_of_agents",),
}

# Every tool a trajectory may name, sorted: the key order of tool_stats / tool_error_counts.
ALL_TOOL_NAMES: tuple[str, ...] = tuple(sorted(t for tools in TOOLSETS.values() for t in tools))
TOOL_TO_TOOLSET: dict[str, str] = {t: ts for ts, tools in TOOLSETS.items() for t in tools}

TOOL_MODULES = (
    "tools.terminal_tool",
    "tools.file_tools",
    "tools.web_tools",
    "tools.browser_tools",
    "tools.vision_tools",
    "tools.image_generation_tool",
    "tools.mixture_of_agents_tool",
)


@dataclass
class ToolContext:
    """What a tool handler may use. One per session."""

    env: "Environment"
    settings: "ToolSettings"
    model: Any  # agent.model_client.SessionModel: `await ctx.model.complete(messages, model=...)`
    task_id: str
    state: dict[str, Any] = field(default_factory=dict)  # per-session scratch (processes, browser page)
    cleanups: list[Callable[[], Any]] = field(default_factory=list)  # sync or async, run at session end


ToolHandler = Callable[[dict, ToolContext], Awaitable[Any]]


@dataclass(frozen=True)
class ToolSpec:
    name: str
    toolset: str
    description: str
    parameters: dict  # JSON schema of the arguments object
    handler: ToolHandler
    # Returns None when usable with these settings, else the reason it is not (e.g. "no SEARXNG_URL").
    unavailable_reason: Callable[["ToolSettings"], str | None] = lambda settings: None

    def openai_schema(self) -> dict:
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.parameters},
        }


_TOOLS: dict[str, ToolSpec] | None = None


def all_tools() -> dict[str, ToolSpec]:
    """Every registered tool by name (imports the tool modules once per process)."""
    global _TOOLS
    if _TOOLS is None:
        tools: dict[str, ToolSpec] = {}
        for module_name in TOOL_MODULES:
            for spec in importlib.import_module(module_name).TOOLS:
                if TOOL_TO_TOOLSET.get(spec.name) != spec.toolset:
                    raise RuntimeError(f"tool {spec.name!r} is not declared in toolset {spec.toolset!r}")
                tools[spec.name] = spec
        _TOOLS = tools
    return _TOOLS


def validate_toolset(name: str) -> bool:
    return name in TOOLSETS


def tool_schema_version() -> str:
    """A short hash of every tool schema: part of the run fingerprint."""
    schemas = [all_tools()[name].openai_schema() for name in ALL_TOOL_NAMES if name in all_tools()]
    blob = json.dumps(schemas, sort_keys=True, ensure_ascii=False).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def unavailable_tools(settings: "ToolSettings") -> dict[str, str]:
    """Tool name -> why it cannot be offered in this run (computed once per run)."""
    reasons = {}
    registered = all_tools()
    for name in ALL_TOOL_NAMES:
        spec = registered.get(name)
        reason = "not implemented" if spec is None else spec.unavailable_reason(settings)
        if reason:
            reasons[name] = reason
    return reasons


def tools_for_toolsets(toolsets: list[str], unavailable: dict[str, str]) -> list[ToolSpec]:
    """The tools offered to the model for these toolsets, in toolset order, without duplicates."""
    registered = all_tools()
    chosen: list[ToolSpec] = []
    seen: set[str] = set()
    for toolset in toolsets:
        for name in TOOLSETS.get(toolset, ()):
            if name not in seen and name not in unavailable:
                seen.add(name)
                chosen.append(registered[name])
    return chosen
