"""The file toolset: read, write, patch and search files in the session's environment.

Reading and writing go through the environment's `read_file` / `write_file`; searching runs
POSIX `find` and `grep -E` through `env.execute` (both exist in busybox), so the tools behave the
same in a local folder, under bubblewrap and in a minimal container. Files are decoded with
surrogateescape, so a patch never alters bytes it does not touch.
"""

from __future__ import annotations

import asyncio
import difflib
import re
from dataclasses import dataclass, field

from tools.environments.base import quote, truncate_output
from tools.registry import ToolContext, ToolSpec

_MAX_LINE_CHARS = 2000  # a minified file must not fill the whole result with one line


class ToolInputError(Exception):
    """Bad arguments or a file that does not suit the request; becomes {"error": ...}."""


def _text_arg(args: dict, name: str, required: bool = True, empty_ok: bool = False) -> str | None:
    value = args.get(name)
    if value is None and not required:
        return None
    if not isinstance(value, str) or (not value and not empty_ok):
        raise ToolInputError(f"{name} must be a {'' if empty_ok else 'non-empty '}string")
    return value


def _int_arg(args: dict, name: str, default: int, minimum: int, maximum: int | None = None) -> int:
    value = args.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ToolInputError(f"{name} must be an integer >= {minimum}")
    return min(value, maximum) if maximum is not None else value


def _tool(handler):
    """Turn ToolInputError into the {"error": ...} result the model sees."""

    async def wrapped(args: dict, ctx: ToolContext) -> dict:
        try:
            return await handler(args, ctx)
        except ToolInputError as err:
            return {"error": str(err)}

    return wrapped


async def _read_text(ctx: ToolContext, path: str) -> str:
    try:
        data = await asyncio.to_thread(ctx.env.read_file, path)
    except FileNotFoundError:
        raise ToolInputError(f"file not found: {path}") from None
    except IsADirectoryError:
        raise ToolInputError(f"{path} is a directory; list it with search_files(target='files')") from None
    except OSError as err:
        raise ToolInputError(f"cannot read {path}: {err.strerror or err}") from None
    if b"\0" in data[:8192]:
        raise ToolInputError(f"{path} is a binary file ({len(data)} bytes); it is not shown as text")
    return data.decode("utf-8", errors="surrogateescape")


async def _write_text(ctx: ToolContext, path: str, text: str) -> int:
    data = text.encode("utf-8", errors="surrogateescape")
    try:
        await asyncio.to_thread(ctx.env.write_file, path, data)
    except OSError as err:
        raise ToolInputError(f"cannot write {path}: {err.strerror or err}") from None
    return len(data)


def _split_lines(text: str) -> tuple[list[str], bool, bool]:
    """Lines without their endings, whether the text ends with a newline, and whether it uses CRLF."""
    crlf = "\r\n" in text
    lines = text.split("\n")
    ends_with_newline = lines[-1] == ""
    if ends_with_newline:
        lines.pop()
    if crlf:
        lines = [line.removesuffix("\r") for line in lines]
    return lines, ends_with_newline, crlf


def _join_lines(lines: list[str], ends_with_newline: bool, crlf: bool) -> str:
    newline = "\r\n" if crlf else "\n"
    return newline.join(lines) + (newline if ends_with_newline and lines else "")


def _diff(path: str, before: str, after: str) -> str:
    diff = difflib.unified_diff(before.splitlines(True), after.splitlines(True), f"a/{path}", f"b/{path}", n=2)
    return truncate_output("".join(diff), 4000)


# --------------------------------------------------------------------------------- read and write


@_tool
async def read_file(args: dict, ctx: ToolContext) -> dict:
    path = _text_arg(args, "path")
    offset = _int_arg(args, "offset", 1, 1)
    limit = _int_arg(args, "limit", 500, 1)
    lines, _, _ = _split_lines(await _read_text(ctx, path))
    if offset > max(len(lines), 1):
        raise ToolInputError(f"offset {offset} is past the end of {path} ({len(lines)} lines)")
    chosen = lines[offset - 1 : offset - 1 + limit]
    numbered = "\n".join(
        f"{number:>6}\t{line[:_MAX_LINE_CHARS]}{' [line cut]' if len(line) > _MAX_LINE_CHARS else ''}"
        for number, line in enumerate(chosen, offset)
    )
    last = offset + len(chosen) - 1
    result = {
        "path": path,
        "content": truncate_output(numbered, ctx.settings.max_output_chars),
        "total_lines": len(lines),
        "first_line": offset,
        "last_line": last,
    }
    if last < len(lines):
        result["note"] = f"{len(lines) - last} more lines; continue with offset={last + 1}"
    return result


@_tool
async def write_file(args: dict, ctx: ToolContext) -> dict:
    path = _text_arg(args, "path")
    content = _text_arg(args, "content", empty_ok=True)
    return {"path": path, "bytes_written": await _write_text(ctx, path, content)}


# ------------------------------------------------------------------------------------------- patch


@_tool
async def patch(args: dict, ctx: ToolContext) -> dict:
    mode = args.get("mode") or "replace"
    if mode == "replace":
        return await _replace(args, ctx)
    if mode == "patch":
        return await _apply_patch(_text_arg(args, "patch"), ctx)
    raise ToolInputError("mode must be 'replace' or 'patch'")


async def _replace(args: dict, ctx: ToolContext) -> dict:
    path = _text_arg(args, "path")
    old = _text_arg(args, "old_string")
    new = _text_arg(args, "new_string", empty_ok=True)
    replace_all = args.get("replace_all") is True
    text = await _read_text(ctx, path)
    count = text.count(old)
    if count == 0:
        raise ToolInputError(
            f"old_string was not found in {path}; it must match exactly, whitespace and indentation included"
        )
    if count > 1 and not replace_all:
        raise ToolInputError(
            f"old_string occurs {count} times in {path}; add surrounding lines to make it unique, "
            "or set replace_all=true"
        )
    updated = text.replace(old, new)
    await _write_text(ctx, path, updated)
    return {"success": True, "path": path, "replacements": count, "diff": _diff(path, text, updated)}


@dataclass
class Hunk:
    lines: list[tuple[str, str]] = field(default_factory=list)  # (" ", "-", "+" or "" for a bare blank line, text)
    start: int | None = None  # unified diff: the hunk's first line in the original file (1-based)
    anchor: str | None = None  # V4A: the text after "@@", a line at or above the hunk
    old_no_newline: bool = False  # "\ No newline at end of file" after an old line
    new_no_newline: bool = False

    def side(self, keep: str) -> list[str]:
        # A bare empty line is a context line whose leading space got lost, except at the very end.
        body = list(self.lines)
        while body and body[-1][0] == "":
            body.pop()
        return [text for kind, text in body if kind in ("", " ", keep)]


@dataclass
class FileChange:
    action: str  # update | add | delete
    path: str
    hunks: list[Hunk] = field(default_factory=list)
    move_to: str | None = None


def _diff_path(header: str) -> str | None:
    name = header.split("\t")[0].strip()
    return None if name == "/dev/null" else name


def _parse_unified(text: str) -> list[FileChange]:
    changes: list[FileChange] = []
    lines = text.split("\n")
    hunk: Hunk | None = None
    for i, line in enumerate(lines):
        if line.startswith("--- ") and i + 1 < len(lines) and lines[i + 1].startswith("+++ "):
            old, new = _diff_path(line[4:]), _diff_path(lines[i + 1][4:])
            if (old is None or old.startswith("a/")) and (new is None or new.startswith("b/")):
                old, new = old and old[2:], new and new[2:]  # git's a/ b/ prefixes
            if old is None and new is None:
                raise ToolInputError("a file header names /dev/null on both sides")
            if old is None:
                changes.append(FileChange("add", new))
            elif new is None:
                changes.append(FileChange("delete", old))
            else:
                changes.append(FileChange("update", old, move_to=new if new != old else None))
            hunk = None
        elif line.startswith("+++ ") and i > 0 and lines[i - 1].startswith("--- "):
            continue
        elif line.startswith("@@"):
            if not changes:
                raise ToolInputError("the patch has a hunk before any '--- file' / '+++ file' header")
            found = re.match(r"@@ -(\d+)", line)
            hunk = Hunk(start=int(found.group(1)) if found else None)
            changes[-1].hunks.append(hunk)
        elif hunk is not None and line.startswith("\\"):
            _mark_no_newline(hunk)
        elif hunk is not None and (line == "" or line[0] in " +-"):
            hunk.lines.append((line[:1], line[1:]))
        else:
            hunk = None  # "diff --git", "index ...", prose: not part of a hunk
    return changes


def _mark_no_newline(hunk: Hunk) -> None:
    kind = hunk.lines[-1][0] if hunk.lines else " "
    if kind in ("", " ", "-"):
        hunk.old_no_newline = True
    if kind in ("", " ", "+"):
        hunk.new_no_newline = True


def _parse_v4a(text: str) -> list[FileChange]:
    changes: list[FileChange] = []
    hunk: Hunk | None = None
    for line in text.split("\n"):
        header = re.match(r"\*\*\* (Update|Add|Delete) File: (.+)", line)
        if header:
            changes.append(FileChange(header.group(1).lower(), header.group(2).strip()))
            hunk = None
        elif line.startswith("*** End Patch"):
            break
        elif line.startswith("*** Move to: ") and changes:
            changes[-1].move_to = line[len("*** Move to: ") :].strip()
        elif line.startswith("***"):
            continue  # "*** Begin Patch", "*** End of File"
        elif not changes:
            continue
        elif changes[-1].action == "add":
            hunk = hunk or _new_hunk(changes[-1])
            hunk.lines.append(("+", line[1:]) if line.startswith("+") else ("", line))
        elif line.startswith("@@"):
            hunk = _new_hunk(changes[-1], anchor=line[2:].strip() or None)
        elif changes[-1].action == "update" and (line == "" or line[0] in " +-"):
            hunk = hunk or _new_hunk(changes[-1])
            hunk.lines.append((line[:1], line[1:]))
    return changes


def _new_hunk(change: FileChange, anchor: str | None = None) -> Hunk:
    change.hunks.append(Hunk(anchor=anchor))
    return change.hunks[-1]


def _find_block(lines: list[str], block: list[str], start: int, hint: int | None) -> int | None:
    """Where `block` occurs at or after `start`: exactly if possible, else ignoring trailing spaces."""
    for same in (lambda a, b: a == b, lambda a, b: a.rstrip() == b.rstrip()):
        spots = [
            i
            for i in range(start, len(lines) - len(block) + 1)
            if all(same(lines[i + k], want) for k, want in enumerate(block))
        ]
        if spots:
            return min(spots, key=lambda i: abs(i - hint)) if hint is not None else spots[0]
    return None


def _apply_hunks(text: str, hunks: list[Hunk], path: str) -> str:
    lines, ends_with_newline, crlf = _split_lines(text)
    position, shift = 0, 0  # hunks apply in order; `shift` tracks how earlier hunks moved lines
    for number, hunk in enumerate(hunks, 1):
        old, new = hunk.side("-"), hunk.side("+")
        begin = position
        if hunk.anchor:
            anchored = next((i for i in range(position, len(lines)) if lines[i].strip() == hunk.anchor), None)
            if anchored is None:  # models often abbreviate the anchor line
                anchored = next((i for i in range(position, len(lines)) if hunk.anchor in lines[i]), None)
            if anchored is None:
                raise ToolInputError(f"{path}: hunk {number}: the line {hunk.anchor!r} after @@ was not found")
            begin = anchored
        if not old:  # a pure insertion: only the header's line number or the anchor says where
            if hunk.start is not None:
                at = min(max(hunk.start + shift, 0), len(lines))  # "@@ -5,0" inserts after line 5
            else:
                at = begin + 1 if hunk.anchor else len(lines)
        else:
            hint = hunk.start - 1 + shift if hunk.start else None
            at = _find_block(lines, old, begin, hint)
            if at is None:
                preview = "\n".join(old[:4])
                raise ToolInputError(
                    f"{path}: hunk {number} does not match the file; its old lines begin with:\n{preview}"
                )
        lines[at : at + len(old)] = new
        if at + len(new) == len(lines) and (hunk.new_no_newline or hunk.old_no_newline):
            ends_with_newline = not hunk.new_no_newline
        position, shift = at + len(new), shift + len(new) - len(old)
    return _join_lines(lines, ends_with_newline, crlf)


async def _apply_patch(text: str, ctx: ToolContext) -> dict:
    text = text.replace("\r\n", "\n")
    changes = _parse_v4a(text) if "*** Begin Patch" in text else _parse_unified(text)
    if not changes:
        raise ToolInputError("no file changes found: expected a unified diff or a '*** Begin Patch' block")
    staged: dict[str, str | None] = {}  # path -> new text, or None to delete; written only if all apply
    originals: dict[str, str | None] = {}

    async def current(path: str) -> str | None:
        if path not in staged:
            try:
                staged[path] = await _read_text(ctx, path)
            except ToolInputError as err:
                if not str(err).startswith("file not found"):
                    raise
                staged[path] = None
            originals[path] = staged[path]
        return staged[path]

    report = []
    for change in changes:
        existing = await current(change.path)
        if change.action == "add":
            if existing is not None:
                raise ToolInputError(f"{change.path} already exists; patch it as an update instead")
            body = [t for h in change.hunks for t in h.side("+")]
            no_newline = any(h.new_no_newline for h in change.hunks)
            staged[change.path] = _join_lines(body, not no_newline, False)
            report.append({"path": change.path, "action": "created"})
            continue
        if existing is None:
            raise ToolInputError(f"file not found: {change.path}")
        if change.action == "delete":
            staged[change.path] = None
            report.append({"path": change.path, "action": "deleted"})
            continue
        updated = _apply_hunks(existing, change.hunks, change.path)
        entry = {"path": change.path, "action": "updated", "hunks": len(change.hunks)}
        if change.move_to:
            await current(change.move_to)
            staged[change.path], staged[change.move_to] = None, updated
            entry.update(action="moved", to=change.move_to)
        else:
            staged[change.path] = updated
        report.append(entry)

    for path, content in staged.items():
        if content is None and originals.get(path) is not None:
            removed = await ctx.env.run(f"rm -f -- {quote(path)}", timeout=30)
            if removed.exit_code != 0:
                raise ToolInputError(f"cannot delete {path}: {removed.output.strip()}")
        elif content is not None and content != originals.get(path):
            await _write_text(ctx, path, content)
    return {"success": True, "files": report}


# ---------------------------------------------------------------------------------- search_files

# grep -E knows POSIX classes, not Perl shorthands, which models use all the time: translate the
# common ones (a plain substitution, so a shorthand inside [...] is not supported).
_SHORTHANDS = {
    "d": "[0-9]", "D": "[^0-9]", "s": "[[:space:]]", "S": "[^[:space:]]", "w": "[[:alnum:]_]", "W": "[^[:alnum:]_]"
}  # fmt: skip
_PRUNED = r"\( -name .git -o -name node_modules -o -name __pycache__ \) -prune -o"
_TOTAL = "__search_total__"


def _to_ere(pattern: str) -> str:
    return re.sub(r"(?<!\\)\\([dDsSwW])", lambda m: _SHORTHANDS[m.group(1)], pattern)


@_tool
async def search_files(args: dict, ctx: ToolContext) -> dict:
    pattern = _text_arg(args, "pattern")
    target = args.get("target") or "content"
    mode = args.get("output_mode") or "content"
    path = _text_arg(args, "path", required=False) or "."
    glob = _text_arg(args, "file_glob", required=False)
    limit = _int_arg(args, "limit", 50, 1, 1000)
    offset = _int_arg(args, "offset", 0, 0)
    context = _int_arg(args, "context", 0, 0, 20)
    if target not in ("content", "files"):
        raise ToolInputError("target must be 'content' or 'files'")
    if mode not in ("content", "files_only", "count"):
        raise ToolInputError("output_mode must be 'content', 'files_only' or 'count'")

    script = f"p={quote(path)}\n" + '[ -e "$p" ] || { echo "no such file or directory: $p"; exit 3; }\n'
    if target == "files":
        script += f'find "$p" {_PRUNED} -type f -name {quote(pattern)} -print | sort'
    else:
        script += (
            f"r={quote(_to_ere(pattern))}\n"
            'err=$(echo | grep -E -e "$r" 2>&1 >/dev/null)\n'
            'if [ $? -ge 2 ]; then echo "invalid regular expression: $err"; exit 2; fi\n'
        )
        name = f"-name {quote(glob)} " if glob else ""
        flags = {"content": f"-nH -C {context}" if context else "-nH", "files_only": "-l", "count": "-cH"}[mode]
        script += f'find "$p" {_PRUNED} -type f {name}-exec grep -E {flags} -e "$r" {{}} + 2>/dev/null'
        script += {"content": "", "files_only": " | sort", "count": " | awk -F: '$NF > 0' | sort"}[mode]
    # Paginate inside the environment, so a huge result never crosses the wire whole.
    script += (
        f" | awk -v a={offset} -v b={offset + limit} "
        f"'NR > a && NR <= b {{ print substr($0, 1, 500) }} END {{ print \"{_TOTAL} \" NR }}'\n"
    )
    result = await ctx.env.run(script, timeout=ctx.settings.command_timeout)
    found = re.search(rf"^{_TOTAL} (\d+)$", result.output, re.MULTILINE)
    if result.exit_code != 0 or not found:
        message = result.output.strip() or f"search failed with exit code {result.exit_code}"
        return {"error": "search timed out" if result.timed_out else message}
    total = int(found.group(1))
    rows = [row.removeprefix("./") for row in result.output[: found.start()].splitlines()]
    answer: dict = {"total": total, "offset": offset, "shown": len(rows)}
    if target == "files" or mode == "files_only":
        answer["files"] = rows
    elif mode == "count":
        answer["counts"] = {row.rpartition(":")[0]: int(row.rpartition(":")[2]) for row in rows}
    else:
        answer["matches"] = "\n".join(rows)
    if offset + len(rows) < total:
        answer["next_offset"] = offset + len(rows)
    if total == 0:
        answer["note"] = "no matches"
    return answer


# ------------------------------------------------------------------------------------------ schemas

_S = {"type": "string"}
_READ = {
    "type": "object",
    "properties": {
        "path": {**_S, "description": "File to read; relative paths start at the task's directory."},
        "offset": {"type": "integer", "default": 1, "description": "First line to show, 1-based."},
        "limit": {"type": "integer", "default": 500, "description": "Number of lines to show."},
    },
    "required": ["path"],
}
_WRITE = {
    "type": "object",
    "properties": {
        "path": {**_S, "description": "File to write; missing parent folders are created."},
        "content": {**_S, "description": "The complete new content of the file."},
    },
    "required": ["path", "content"],
}
_PATCH = {
    "type": "object",
    "properties": {
        "mode": {"type": "string", "enum": ["replace", "patch"], "default": "replace", "description": "Kind of edit."},
        "path": {**_S, "description": "replace: the file to edit."},
        "old_string": {**_S, "description": "replace: the exact text to find."},
        "new_string": {**_S, "description": "replace: the text to put instead."},
        "replace_all": {"type": "boolean", "default": False, "description": "replace: change every occurrence."},
        "patch": {**_S, "description": "patch: a unified diff or a '*** Begin Patch' block, one or more files."},
    },
    "required": ["mode"],
}
_SEARCH = {
    "type": "object",
    "properties": {
        "pattern": {**_S, "description": "Regular expression (content) or file-name glob (files)."},
        "target": {
            "type": "string",
            "enum": ["content", "files"],
            "default": "content",
            "description": "content: lines inside files; files: file names.",
        },
        "path": {**_S, "default": ".", "description": "File or folder to search in."},
        "file_glob": {**_S, "description": "content: only files whose name matches this glob, e.g. '*.py'."},
        "limit": {"type": "integer", "default": 50, "description": "Maximum results to return."},
        "offset": {"type": "integer", "default": 0, "description": "Results to skip, for paging."},
        "output_mode": {
            "type": "string",
            "enum": ["content", "files_only", "count"],
            "default": "content",
            "description": "content: matching lines; files_only: file names; count: matches per file.",
        },
        "context": {"type": "integer", "default": 0, "description": "content: lines of context around each match."},
    },
    "required": ["pattern"],
}

TOOLS = [
    ToolSpec(
        "read_file",
        "file",
        "Read a text file with numbered lines, `limit` lines from line `offset`, and its total line "
        "count. Binary files are refused.",
        _READ,
        read_file,
        needs_sandbox=True,
    ),
    ToolSpec(
        "write_file",
        "file",
        "Create or overwrite a file with the given content (parent folders are created). Returns the "
        "number of bytes written.",
        _WRITE,
        write_file,
        needs_sandbox=True,
    ),
    ToolSpec(
        "patch",
        "file",
        "Edit files. mode=replace: replace old_string with new_string in `path`; old_string must "
        "occur exactly once unless replace_all=true. mode=patch: apply `patch`, either a unified diff "
        "(---/+++ headers and @@ hunks; several files, new files from /dev/null, deletions to "
        "/dev/null) or a block from '*** Begin Patch' to '*** End Patch' with '*** Update File:', "
        "'*** Add File:', '*** Delete File:' and '*** Move to:' sections. Nothing is written unless "
        "every hunk applies.",
        _PATCH,
        patch,
        needs_sandbox=True,
    ),
    ToolSpec(
        "search_files",
        "file",
        "Search under `path`. target=content: lines matching the extended regular expression "
        "`pattern`, optionally only in files named like `file_glob`, with `context` lines around "
        "them, as 'file:line:text' (content), file names (files_only) or counts per file (count). "
        "target=files: files whose name matches the glob `pattern`. Skips .git, node_modules and "
        "__pycache__. Results are paged with `limit` and `offset`.",
        _SEARCH,
        search_files,
        needs_sandbox=True,
    ),
]
