"""vision_analyze: ask the vision model a question about an image given by URL or local path."""

from __future__ import annotations

import asyncio
import base64
import mimetypes
import os

from tools.registry import ToolContext, ToolSpec

MAX_IMAGE_BYTES = 20 * 1024 * 1024

# Leading bytes of the image formats vision endpoints accept.
_SIGNATURES = (
    (b"\x89PNG\r\n\x1a\n", "image/png"),
    (b"\xff\xd8\xff", "image/jpeg"),
    (b"GIF87a", "image/gif"),
    (b"GIF89a", "image/gif"),
    (b"BM", "image/bmp"),
)


def image_mime_type(data: bytes, path: str = "") -> str | None:
    """The image type of `data`, from its first bytes (else from the file name); None if not an image."""
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "image/webp"
    for signature, mime in _SIGNATURES:
        if data.startswith(signature):
            return mime
    guessed = mimetypes.guess_type(path)[0]
    return guessed if guessed and guessed.startswith("image/") else None


def _read_image(ctx: ToolContext, path: str) -> bytes:
    """Read from the session's environment. Only with the unsandboxed local backend (where the
    environment is the host anyway) may a path fall back to the host: a model in a container or
    under bubblewrap must not read host files."""
    try:
        if ctx.env is None:
            raise FileNotFoundError(path)
        return ctx.env.read_file(path)
    except Exception as env_error:
        host_path = os.path.expanduser(path)
        if ctx.settings.terminal_env == "local" and not ctx.settings.sandbox and os.path.isfile(host_path):
            with open(host_path, "rb") as fh:
                return fh.read(MAX_IMAGE_BYTES + 1)
        if isinstance(env_error, FileNotFoundError):
            raise
        raise FileNotFoundError(f"{path}: {env_error}") from env_error


async def image_to_url(ctx: ToolContext, image: str) -> str:
    """An http(s)/data URL is used as is; a local path becomes a base64 data URL."""
    if image.lower().startswith(("http://", "https://", "data:")):
        return image
    path = image[len("file://") :] if image.startswith("file://") else image
    data = await asyncio.to_thread(_read_image, ctx, path)
    if len(data) > MAX_IMAGE_BYTES:
        raise ValueError(f"{path} is larger than {MAX_IMAGE_BYTES // (1024 * 1024)} MB")
    mime = image_mime_type(data, path)
    if mime is None:
        raise ValueError(f"{path} is not a PNG, JPEG, GIF, WebP or BMP image")
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


async def vision_analyze(args: dict, ctx: ToolContext) -> dict:
    image = str(args.get("image_url") or "").strip()
    question = str(args.get("question") or "").strip()
    if not image or not question:
        return {"error": "image_url and question are both required"}
    try:
        url = await image_to_url(ctx, image)
    except FileNotFoundError:
        return {"error": f"image not found: {image}"}
    except (OSError, ValueError) as exc:
        return {"error": str(exc)}
    messages = [
        {
            "role": "user",
            "content": [{"type": "text", "text": question}, {"type": "image_url", "image_url": {"url": url}}],
        }
    ]
    model = ctx.settings.vision_model or ctx.settings.model
    try:
        reply = await ctx.model.complete(messages, model=model, max_tokens=None)
    except Exception as exc:  # agent.types.ProviderError and transport failures
        return {"error": f"vision model {model} failed: {exc}"}
    if not (reply.content or "").strip():
        return {"error": f"vision model {model} returned an empty answer"}
    return {"analysis": reply.content}


TOOLS = [
    ToolSpec(
        name="vision_analyze",
        toolset="vision",
        description=(
            "Look at an image and answer a question about it: describe it, read its text, inspect a "
            "chart or screenshot. The image can be an http(s) URL or a path to a local image file."
        ),
        parameters={
            "type": "object",
            "properties": {
                "image_url": {"type": "string", "description": "An http(s) image URL or a local file path."},
                "question": {"type": "string", "description": "What you want to know about the image."},
            },
            "required": ["image_url", "question"],
        },
        handler=vision_analyze,
        needs_settings=("vision_model", "model"),
        needs_settings_reason="no model configured for vision",
    )
]
