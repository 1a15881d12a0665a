"""The built-in offline model (`--model=mock`): deterministic, in-process, no network, no key.

It behaves like a small, careful tool-using model so that the demo and dry runs exercise the whole
pipeline for real: it reasons (native `reasoning` field), plans tool calls from the prompt's words
and the tools it is offered, runs them one per turn, reads their results and then answers.
The same prompt with the same tools always gives the same conversation.
"""

from __future__ import annotations

import json
import re
from typing import Any

from agent.model_client import CallStats
from agent.types import ModelReply

# Planning reads a bounded prefix of the prompt, token by token: the work per call is linear in at
# most SCAN_CHARS characters, so even a megabyte prompt plans in milliseconds and never holds up
# the worker's event loop (an unanchored search like `[\w./-]+\.png` restarts at every position of
# a long word, which is quadratic).
SCAN_CHARS = 20_000
_URL = re.compile(r"https?://[^\s)\"'>]+")
_TOKEN_SPLIT = re.compile(r"[\s\"'()<>\[\]{},;]+")
_IMAGE = re.compile(r"(?:https?://)?[\w./-]+\.(?:png|jpe?g|gif|webp)", re.IGNORECASE)
_FILENAME = re.compile(r"[\w-]+\.(?:txt|md|py|json|csv|sh|log)")


def _tokens(text: str) -> list[str]:
    """Whitespace/bracket separated words, without trailing sentence punctuation."""
    return [t.rstrip(".:!?") for t in _TOKEN_SPLIT.split(text) if t]


def _images(tokens: list[str]) -> list[str]:
    return [t for t in tokens if _IMAGE.fullmatch(t)]  # anchored at both ends: one pass per token


def _filenames(tokens: list[str]) -> list[str]:
    names = (t.rsplit("/", 1)[-1] for t in tokens if not t.startswith(("http://", "https://")))
    return [n for n in names if _FILENAME.fullmatch(n)]


def _has(prompt: str, *words: str) -> bool:
    return any(w in prompt for w in words)


def plan_tool_calls(prompt: str, offered: set[str]) -> list[tuple[str, dict]]:
    """The tool calls the mock makes for this prompt, in order (at most one per turn)."""
    prompt = prompt[:SCAN_CHARS]
    text = prompt.lower()
    plan: list[tuple[str, dict]] = []

    def add(tool: str, args: dict) -> None:
        if tool in offered:
            plan.append((tool, args))

    tokens = _tokens(prompt)
    urls = _URL.findall(prompt)
    images = _images(tokens)
    filename = (_filenames(tokens) or ["notes.txt"])[0]

    if urls and "browser_navigate" in offered:
        add("browser_navigate", {"url": urls[0]})
        add("browser_snapshot", {"full": False})
    elif urls:
        add("web_extract", {"urls": urls[:2], "char_limit": 2000})
    if _has(text, "search the web", "look up", "research", "latest", "news"):
        add("web_search", {"query": prompt.strip()[:120], "limit": 3})
    if images:
        add("vision_analyze", {"image_url": images[0], "question": "Describe this image in detail."})
    if _has(text, "draw", "picture", "illustration", "generate an image", "logo"):
        add("image_generate", {"prompt": prompt.strip()[:200], "aspect_ratio": "square"})
    if _has(text, "write", "create", "save", "file", "script", "edit", "fix"):
        body = f"# {filename}\nNotes for the task: {prompt.strip()[:120]}\nstatus: draft\n"
        add("write_file", {"path": filename, "content": body})
        if _has(text, "edit", "fix", "update", "change"):
            add("patch", {"mode": "replace", "path": filename, "old_string": "status: draft", "new_string": "status: done"})
        add("read_file", {"path": filename})
    if _has(text, "search", "find", "grep", "where"):
        add("search_files", {"pattern": "status", "path": ".", "target": "content"})
    command = _terminal_command(text)
    if command:
        add("terminal", {"command": command})
    if _has(text, "opinion", "compare", "debate", "pros and cons", "think hard"):
        add("mixture_of_agents", {"user_prompt": prompt.strip()[:500]})
    if not plan and "terminal" in offered:
        add("terminal", {"command": "pwd && ls -la"})
    return plan


def _terminal_command(text: str) -> str | None:
    if _has(text, "python", "compute", "calculate", "sum"):
        return "awk 'BEGIN { s = 0; for (i = 1; i <= 100; i++) s += i; print \"sum(1..100) =\", s }'"
    if _has(text, "list", "directory", "folder", "files"):
        return "ls -la"
    if _has(text, "system", "kernel", "os ", "machine"):
        return "uname -a"
    if _has(text, "date", "time", "year"):
        return "date -u +%Y-%m-%dT%H:%M:%SZ"
    if _has(text, "count", "lines", "words"):
        return "printf 'alpha\\nbeta\\ngamma\\n' | wc -l"
    if _has(text, "run", "shell", "command", "terminal", "echo"):
        return "echo hello from the sandbox && pwd"
    return None


def _estimate_tokens(messages: list[dict]) -> int:
    return sum(len(str(m.get("content") or "")) for m in messages) // 4 + 1


def _session_messages(messages: list[dict]) -> list[dict]:
    """The request without the prefilled example exchange (--prefill_messages): a session's own
    assistant turns all call tools (its final answer ends it), so the messages after the last
    assistant message without tool calls are the session's."""
    start = 0
    for i, message in enumerate(messages):
        if message.get("role") == "assistant" and not message.get("tool_calls"):
            start = i + 1
    return messages[start:]


def _row_prompt(messages: list[dict]) -> Any:
    """The row's prompt: the last user message before the session's first assistant turn (prefilled
    user messages come before it; the loop's own notes come after)."""
    prompt: Any = ""
    for message in messages:
        if message.get("role") == "assistant":
            break
        if message.get("role") == "user":
            prompt = message.get("content") or ""
    return prompt


def answered_as(model: str) -> str:
    """The name a request's spend is listed under: the mock answers in place of every model a tool
    names (mixture_of_agents' reference models, say), and a spend listed under that model's own name
    would read as paid traffic."""
    return model if model == "mock" else f"mock (for {model})"


class MockModelClient:
    """Drop-in replacement for ModelClient.complete(), answering from `plan_tool_calls`."""

    async def complete(
        self,
        messages: list[dict],
        *,
        model: str,
        tools: list[dict] | None = None,
        tool_choice: str | None = None,
        max_tokens: int | None = None,
        extra_body: dict | None = None,
        stats: CallStats | None = None,
    ) -> ModelReply:
        reply = self._reply(messages, [] if tool_choice == "none" else tools or [])
        completion_tokens = (len(reply.content or "") + len(reply.reasoning or "")) // 4 + 1
        reply.usage = {
            "prompt_tokens": _estimate_tokens(messages),
            "completion_tokens": completion_tokens,
            "reasoning_tokens": len(reply.reasoning or "") // 4,
            "cached_tokens": 0,
            "total_tokens": _estimate_tokens(messages) + completion_tokens,
            "cost": None,  # priced by the run's prices: free (0) unless --price_* flags are given
        }
        if stats is not None:
            stats.count_request(answered_as(model))
            stats.add_usage(reply.usage, answered_as(model))
        return reply

    async def close(self) -> None:
        return None

    def _reply(self, messages: list[dict], tools: list[dict]) -> ModelReply:
        messages = _session_messages(messages)
        prompt = _row_prompt(messages)
        if not isinstance(prompt, str):  # multimodal request (vision): answer about the text part
            prompt = " ".join(p.get("text", "") for p in prompt if isinstance(p, dict))
        if not tools:
            return ModelReply(
                content=f"(offline model) A considered answer to: {prompt.strip()[:200]}",
                reasoning="No tools are available for this request, so I answer directly.",
                tool_calls=[],
                finish_reason="stop",
            )
        offered = {t["function"]["name"] for t in tools}
        plan = plan_tool_calls(prompt, offered)
        step = sum(1 for m in messages if m.get("role") == "assistant")
        if step < len(plan):
            name, args = plan[step]
            return ModelReply(
                content=None,
                reasoning=f"Step {step + 1} of {len(plan)}: to make progress on the request I will call `{name}`.",
                tool_calls=[
                    {"id": f"call_{step}_0", "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}
                ],
                finish_reason="tool_calls",
            )
        return ModelReply(
            content=self._final_answer(messages, plan),
            reasoning="I have what I need from the tool results; time to summarise them for the user.",
            tool_calls=[],
            finish_reason="stop",
        )

    @staticmethod
    def _final_answer(messages: list[dict], plan: list[tuple[str, Any]]) -> str:
        if not plan:
            return "I can answer this without tools: here is my best answer based on what I know."
        results = [str(m.get("content") or "") for m in messages if m.get("role") == "tool"]
        last = results[-1][:300] if results else "(no result)"
        used = ", ".join(dict.fromkeys(name for name, _ in plan))
        return f"Done. I used {len(plan)} tool call(s) ({used}). The last result was:\n{last}"
