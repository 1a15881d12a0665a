"""The tool registry: schemas, toolsets, availability, and the deterministic list of all tools.

Each tool module exposes `TOOLS: list[ToolSpec]`; a spec declares its toolset and what it needs
(a sandbox, packages, settings), and everything else is derived from the specs: the toolsets, the
sorted list of all tools, which tools a run can offer. Adding a tool = its spec in its module (and,
for a new module, one line in TOOL_MODULES). Tool modules are imported on first use (only when a
session needs tools or a catalogue is read) so `--list_distributions` and the CLI's validation
stay fast.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import importlib.util
import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Awaitable, Callable

if TYPE_CHECKING:
    from tools.environments.base import Environment
    from tools.settings import ToolSettings

# The tool modules, in toolset order: the one line to add for a new tool module. The toolsets, their
# tool order and ALL_TOOL_NAMES are derived from the specs these modules declare.
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
    """One tool: its schema, its handler, and what it needs to be offered in a run."""

    name: str
    toolset: str
    description: str
    parameters: dict  # JSON schema of the arguments object
    handler: ToolHandler
    # The worker starts the task's environment (sandbox, container) only for sessions with such a tool.
    needs_sandbox: bool = False
    # Python packages the handler imports; a missing one: "<package> is not installed (pip install <package>)".
    packages: tuple[str, ...] = ()
    # ToolSettings fields of which at least one must be set, and the reason given when none is.
    needs_settings: tuple[str, ...] = ()
    needs_settings_reason: str = ""
    # What a declaration cannot say (a backend chosen among several, a browser binary on disk):
    # returns None when usable with these settings, else the reason it is not.
    check: Callable[["ToolSettings"], str | None] | None = None

    def openai_schema(self) -> dict:
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.parameters},
        }


_TOOLS: dict[str, ToolSpec] | None = None


def all_tools() -> dict[str, ToolSpec]:
    """Every registered tool by name, in toolset order (imports the tool modules once per process)."""
    global _TOOLS
    if _TOOLS is None:
        tools: dict[str, ToolSpec] = {}
        for module_name in TOOL_MODULES:
            for spec in importlib.import_module(module_name).TOOLS:
                if spec.name in tools:
                    raise RuntimeError(f"tool {spec.name!r} is declared twice ({module_name})")
                tools[spec.name] = spec
        _TOOLS = tools
    return _TOOLS


@functools.cache
def toolsets() -> dict[str, tuple[str, ...]]:
    """Toolset -> its tools, both in the order the modules declare them."""
    catalogue: dict[str, tuple[str, ...]] = {}
    for spec in all_tools().values():
        catalogue[spec.toolset] = (*catalogue.get(spec.toolset, ()), spec.name)
    return catalogue


@functools.cache
def all_tool_names() -> tuple[str, ...]:
    """Every tool a trajectory may name, sorted: the key order of tool_stats / tool_error_counts."""
    return tuple(sorted(all_tools()))


def __getattr__(name: str) -> Any:
    # `TOOLSETS` and `ALL_TOOL_NAMES` read like constants but are derived from the specs, so they
    # are built on first use (importing the tool modules), not when this module is imported.
    if name == "TOOLSETS":
        return toolsets()
    if name == "ALL_TOOL_NAMES":
        return all_tool_names()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def validate_toolset(name: str) -> bool:
    return name in toolsets()


@functools.cache
def tool_schema_version() -> str:
    """A short hash of every tool schema: part of the run fingerprint."""
    schemas = [all_tools()[name].openai_schema() for name in all_tool_names()]
    blob = json.dumps(schemas, sort_keys=True, ensure_ascii=False).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def unavailable_reason(spec: ToolSpec, settings: "ToolSettings") -> str | None:
    """None when the tool can be offered with these settings, else why not (shown to the user)."""
    for package in spec.packages:
        if importlib.util.find_spec(package) is None:
            return f"{package} is not installed (pip install {package})"
    if spec.needs_settings and not any(getattr(settings, name) for name in spec.needs_settings):
        return spec.needs_settings_reason
    return spec.check(settings) if spec.check else None


def unavailable_tools(settings: "ToolSettings") -> dict[str, str]:
    """Tool name -> why it cannot be offered in this run (computed once per run), in sorted order."""
    reasons = {}
    for name in all_tool_names():
        reason = unavailable_reason(all_tools()[name], settings)
        if reason:
            reasons[name] = reason
    return reasons


def tools_for_toolsets(names: list[str], unavailable: dict[str, str]) -> list[ToolSpec]:
    """The tools offered to the model for these toolsets, in toolset order, without duplicates."""
    registered, catalogue = all_tools(), toolsets()
    chosen: list[ToolSpec] = []
    seen: set[str] = set()
    for toolset in names:
        for name in catalogue.get(toolset, ()):
            if name not in seen and name not in unavailable:
                seen.add(name)
                chosen.append(registered[name])
    return chosen
