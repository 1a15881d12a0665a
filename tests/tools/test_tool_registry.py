"""The tool registry: the catalogue derived from the specs is the original's, the schemas unchanged,
and what a spec declares it needs decides whether the tool is offered."""

from __future__ import annotations

import subprocess
import sys

from tools import registry
from tools.registry import ToolSpec, unavailable_reason, unavailable_tools
from tools.settings import ToolSettings

# Toolset -> tools exactly as the original's tool interfaces list them (order included:
# it is the order the tools are offered to the model).
ORIGINAL_CATALOGUE = {
    "terminal": ("terminal", "process"),
    "file": ("read_file", "write_file", "patch", "search_files"),
    "web": ("web_search", "web_extract"),
    "browser": (
        "browser_navigate", "browser_snapshot", "browser_click", "browser_type", "browser_scroll",
        "browser_back", "browser_press", "browser_close", "browser_get_images", "browser_vision",
        "browser_console",
    ),
    "vision": ("vision_analyze",),
    "image_gen": ("image_generate",),
    "moa": ("mixture_of_agents",),
}

# The hash of every tool schema before the toolsets were derived from the specs: names,
# descriptions and parameters are byte-identical, so runs fingerprinted before still resume.
SCHEMA_VERSION = "a41a7a445e4a0db8"


def test_toolsets_derived_from_the_specs_are_the_originals():
    assert list(registry.TOOLSETS.items()) == list(ORIGINAL_CATALOGUE.items())
    assert registry.ALL_TOOL_NAMES == tuple(sorted(t for tools in ORIGINAL_CATALOGUE.values() for t in tools))
    assert list(registry.all_tools()) == [t for tools in ORIGINAL_CATALOGUE.values() for t in tools]


def test_tool_schemas_are_unchanged():
    assert registry.tool_schema_version() == SCHEMA_VERSION


def test_only_terminal_and_file_tools_need_the_sandbox():
    needing = {spec.name for spec in registry.all_tools().values() if spec.needs_sandbox}
    assert needing == set(ORIGINAL_CATALOGUE["terminal"] + ORIGINAL_CATALOGUE["file"])


def test_importing_the_registry_imports_no_tool_module():
    code = ("import sys, tools.registry, toolset_distributions; "
            "print(sorted(m for m in sys.modules if m.startswith('tools.') and m != 'tools.registry'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


async def _noop(args, ctx):
    return {}


def _spec(**needs) -> ToolSpec:
    return ToolSpec("t", "x", "A test tool.", {"type": "object", "properties": {}}, _noop, **needs)


def test_a_missing_package_is_named_with_its_install_command():
    spec = _spec(packages=("json", "no_such_package_here"))
    assert unavailable_reason(spec, ToolSettings()) == "no_such_package_here is not installed (pip install no_such_package_here)"


def test_settings_needed_are_any_of_the_fields_named():
    spec = _spec(needs_settings=("vision_model", "model"), needs_settings_reason="no model")
    assert unavailable_reason(spec, ToolSettings(model="")) == "no model"
    assert unavailable_reason(spec, ToolSettings(model="", vision_model="v")) is None


def test_packages_are_checked_before_settings_and_the_check():
    spec = _spec(packages=("no_such_package_here",), needs_settings=("model",), needs_settings_reason="no model",
                 check=lambda settings: "checked")
    assert "not installed" in unavailable_reason(spec, ToolSettings(model=""))
    assert unavailable_reason(_spec(check=lambda settings: "checked"), ToolSettings()) == "checked"


def test_unconfigured_tools_keep_the_reasons_users_see():
    reasons = unavailable_tools(ToolSettings(browser_executable="/nope/chromium"))
    assert list(reasons) == sorted(reasons)
    assert reasons["web_search"].startswith("no search backend configured")
    assert reasons["image_generate"] == "no image backend configured: set FAL_KEY or IMAGES_BASE_URL"
    assert reasons["browser_navigate"].startswith("Chromium not found at /nope/chromium")
    assert not {"terminal", "read_file", "web_extract", "vision_analyze", "mixture_of_agents"} & set(reasons)
