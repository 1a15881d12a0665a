"""Named toolset distributions and per-prompt sampling of the toolsets a sample may use.

A distribution maps toolset names to inclusion percentages. Each prompt gets its own draw: every
toolset is an independent Bernoulli trial, so a distribution describes how often a toolset
appears, not a fixed combination. Imports only the stdlib and `tools.registry` (stdlib-only at
import time) so that `--list_distributions` stays fast.
"""

from __future__ import annotations

import hashlib
import logging
import random
from typing import Any

from tools import registry

log = logging.getLogger(__name__)

# The original's catalogue, `moa` kept on purpose. Insertion order of the toolsets
# matters: it is the order of the Bernoulli trials, of the result list and of tie-breaking.
DISTRIBUTIONS: dict[str, dict[str, Any]] = {
    "default": {
        "description": "All available tools, all the time",
        "toolsets": {
            "web": 100,
            "vision": 100,
            "image_gen": 100,
            "terminal": 100,
            "file": 100,
            "moa": 100,
            "browser": 100,
        },
    },
    "image_gen": {
        "description": "Heavy focus on image generation with vision and web support",
        "toolsets": {"image_gen": 90, "vision": 90, "web": 55, "terminal": 45, "moa": 10},
    },
    "research": {
        "description": "Web research with vision analysis and reasoning",
        "toolsets": {"web": 90, "browser": 70, "vision": 50, "moa": 40, "terminal": 10},
    },
    "science": {
        "description": "Scientific research with web, terminal, file, and browser capabilities",
        "toolsets": {
            "web": 94,
            "terminal": 94,
            "file": 94,
            "vision": 65,
            "browser": 50,
            "image_gen": 15,
            "moa": 10,
        },
    },
    "development": {
        "description": "Terminal, file tools, and reasoning with occasional web lookup",
        "toolsets": {"terminal": 80, "file": 80, "moa": 60, "web": 30, "vision": 10},
    },
    "safe": {
        "description": "All tools except terminal for safety",
        "toolsets": {"web": 80, "browser": 70, "vision": 60, "image_gen": 60, "moa": 50},
    },
    "balanced": {
        "description": "Equal probability of all toolsets",
        "toolsets": {
            "web": 50,
            "vision": 50,
            "image_gen": 50,
            "terminal": 50,
            "file": 50,
            "moa": 50,
            "browser": 50,
        },
    },
    "minimal": {
        "description": "Only web tools for basic research",
        "toolsets": {"web": 100},
    },
    "terminal_only": {
        "description": "Terminal and file tools for code execution tasks",
        "toolsets": {"terminal": 100, "file": 100},
    },
    "terminal_web": {
        "description": "Terminal and file tools with web search for documentation lookup",
        "toolsets": {"terminal": 100, "file": 100, "web": 100},
    },
    "creative": {
        "description": "Image generation and vision analysis focus",
        "toolsets": {"image_gen": 90, "vision": 90, "web": 30},
    },
    "reasoning": {
        "description": "Heavy mixture of agents usage with minimal other tools",
        "toolsets": {"moa": 90, "web": 30, "terminal": 20},
    },
    "browser_use": {
        "description": "Full browser-based web interaction with search, vision, and page control",
        "toolsets": {"browser": 100, "web": 80, "vision": 70},
    },
    "browser_only": {
        "description": "Only browser automation tools for pure web interaction tasks",
        "toolsets": {"browser": 100},
    },
    "browser_tasks": {
        "description": (
            "Browser-focused distribution (browser toolset includes web_search for finding URLs "
            "since Google blocks direct browser searches)"
        ),
        "toolsets": {"browser": 97, "vision": 12, "terminal": 15},
    },
    "terminal_tasks": {
        "description": (
            "Terminal-focused distribution with high terminal/file availability, occasional other tools"
        ),
        "toolsets": {
            "terminal": 97,
            "file": 97,
            "web": 97,
            "browser": 75,
            "vision": 50,
            "image_gen": 10,
        },
    },
    "mixed_tasks": {
        "description": (
            "Mixed distribution with high browser, terminal, and file availability for complex tasks"
        ),
        "toolsets": {
            "browser": 92,
            "terminal": 92,
            "file": 92,
            "web": 35,
            "vision": 15,
            "image_gen": 15,
        },
    },
}

# (distribution, toolset) pairs already warned about: sampling runs once per prompt, and one
# warning per prompt would drown the console in a large run.
_warned_invalid: set[tuple[str, str]] = set()


def get_distribution(name: str) -> dict[str, Any] | None:
    return DISTRIBUTIONS.get(name)


def list_distributions() -> dict[str, dict[str, Any]]:
    """A shallow copy, so callers can add or drop entries without touching the catalogue."""
    return dict(DISTRIBUTIONS)


def validate_distribution(name: str) -> bool:
    return name in DISTRIBUTIONS


def _is_valid_toolset(distribution: str, toolset: str) -> bool:
    # Looked up through the module so tests (and a future dynamic registry) can substitute it.
    if registry.validate_toolset(toolset):
        return True
    if (distribution, toolset) not in _warned_invalid:
        _warned_invalid.add((distribution, toolset))
        log.warning("Toolset %r in distribution %r is not valid; it is skipped", toolset, distribution)
    return False


def sample_toolsets_from_distribution(name: str, rng: random.Random | None = None) -> list[str]:
    """Draw the toolsets for one prompt, in the distribution's insertion order.

    Never empty when the distribution has a valid toolset: downstream an empty list could be
    mistaken for "no restriction", so the most likely valid toolset is used as a fallback.
    """
    dist = DISTRIBUTIONS.get(name)
    if dist is None:
        raise ValueError(f"Unknown distribution: {name}")
    draw = (rng or random).random
    valid = [(ts, p) for ts, p in dist["toolsets"].items() if _is_valid_toolset(name, ts)]
    # One trial per valid toolset, always in the same order, so a seeded rng gives the same result.
    chosen = [ts for ts, p in valid if draw() * 100 < p]
    if not chosen and valid:
        # max() keeps the first of equal maxima, i.e. insertion order breaks ties.
        chosen = [max(valid, key=lambda item: item[1])[0]]
    return chosen


def rng_for_row(seed: int, row_key: str) -> random.Random:
    """A generator that depends only on (seed, row_key).

    Deriving it per row (instead of sharing one stream) makes each prompt's sample independent of
    worker count, batch layout and finishing order. sha256 rather than hash(): str hashing is
    randomised per process. The seed is an int, so the first ':' separates the two parts.
    """
    digest = hashlib.sha256(f"{seed}:{row_key}".encode("utf-8")).digest()
    return random.Random(int.from_bytes(digest, "big"))


def _distribution_lines(name: str) -> list[str]:
    dist = DISTRIBUTIONS[name]
    lines = ["", f"📊 Distribution: {name}", f"   Description: {dist['description']}", "   Toolsets:"]
    # sorted() is stable, so equal percentages keep their insertion order.
    for toolset, prob in sorted(dist["toolsets"].items(), key=lambda item: -item[1]):
        lines.append(f"     • {toolset:<15} : {prob:>3}% chance")
    return lines


def format_distribution_catalogue() -> str:
    """The text of `--list_distributions`: every distribution sorted by name, then a usage hint."""
    lines = ["📊 Available Toolset Distributions", "=" * 70]
    for name in sorted(DISTRIBUTIONS):
        lines.extend(_distribution_lines(name))
    lines += [
        "",
        "💡 Usage:",
        "  python batch_runner.py --dataset_file=data.jsonl --batch_size=10 \\",
        "                         --run_name=my_run --distribution=<name>",
    ]
    return "\n".join(lines)


def print_distribution_info(name: str) -> None:
    if name not in DISTRIBUTIONS:
        print(f"❌ Unknown distribution: {name}")
        return
    print("\n".join(_distribution_lines(name)))
