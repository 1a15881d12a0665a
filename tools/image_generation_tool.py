"""image_generate: text-to-image through FAL or an OpenAI-compatible images endpoint."""

from __future__ import annotations

import asyncio
import base64
import os
import secrets
import tempfile
from typing import TYPE_CHECKING

from tools.registry import ToolContext, ToolSpec

if TYPE_CHECKING:
    import httpx  # imported where a request is made: heavy (its CLI pulls rich), and most runs never need it

FAL_BASE_URL = "https://fal.run"  # module constant so tests can point it at a local server
DEFAULT_FAL_MODEL = "fal-ai/flux/schnell"
DEFAULT_OPENAI_MODEL = "gpt-image-1"
IMAGE_BACKENDS = ("fal", "openai")
ASPECT_RATIOS = ("landscape", "square", "portrait")
FAL_SIZES = {"landscape": "landscape_16_9", "square": "square_hd", "portrait": "portrait_16_9"}
OPENAI_SIZES = {"landscape": "1536x1024", "square": "1024x1024", "portrait": "1024x1536"}
HTTP_TIMEOUT = 180.0


def _secret(value) -> str | None:
    return (value.get_secret_value() if hasattr(value, "get_secret_value") else value) or None


def _fal_key(settings) -> str | None:
    return _secret(settings.fal_key) or os.environ.get("FAL_KEY") or None


def _images_base_url(settings) -> str | None:
    return settings.images_base_url or os.environ.get("IMAGES_BASE_URL") or None


def image_backend(settings) -> str | None:
    """The chosen backend if configured, else the first configured one, else None."""
    configured = {"fal": bool(_fal_key(settings)), "openai": bool(_images_base_url(settings))}
    if settings.image_backend:
        return settings.image_backend if configured.get(settings.image_backend) else None
    return next((name for name in IMAGE_BACKENDS if configured[name]), None)


def _unavailable(settings) -> str | None:
    if image_backend(settings):
        return None
    if settings.image_backend == "fal":
        return "image backend 'fal' selected but FAL_KEY is not set"
    if settings.image_backend == "openai":
        return "image backend 'openai' selected but IMAGES_BASE_URL is not set"
    if settings.image_backend:
        return f"unknown image backend {settings.image_backend!r} (choose fal or openai)"
    return "no image backend configured: set FAL_KEY or IMAGES_BASE_URL"


async def _fal(client: httpx.AsyncClient, settings, prompt: str, aspect: str, image_url, references) -> dict:
    model = settings.image_model or DEFAULT_FAL_MODEL
    body: dict = {"prompt": prompt, "image_size": FAL_SIZES[aspect], "num_images": 1}
    if image_url:
        body["image_url"] = image_url
    if references:
        body["image_urls"] = references
    resp = await client.post(
        f"{FAL_BASE_URL}/{model}", json=body, headers={"Authorization": f"Key {_fal_key(settings)}"}
    )
    resp.raise_for_status()
    images = resp.json().get("images") or []
    if not images or not images[0].get("url"):
        raise ValueError("FAL returned no image")
    return {"image_url": images[0]["url"], "backend": "fal", "model": model}


async def _openai(client: httpx.AsyncClient, ctx: ToolContext, prompt: str, aspect: str) -> dict:
    settings = ctx.settings
    model = settings.image_model or DEFAULT_OPENAI_MODEL
    key = _secret(settings.images_api_key) or os.environ.get("IMAGES_API_KEY")
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    body = {"model": model, "prompt": prompt, "size": OPENAI_SIZES[aspect], "n": 1}
    resp = await client.post(f"{_images_base_url(settings).rstrip('/')}/images/generations", json=body, headers=headers)
    resp.raise_for_status()
    data = resp.json().get("data") or []
    if not data:
        raise ValueError("the images endpoint returned no image")
    if data[0].get("url"):
        return {"image_url": data[0]["url"], "backend": "openai", "model": model}
    if data[0].get("b64_json"):
        # No URL to hand back: save the image in the session's environment (or, without one, on the host).
        image = base64.b64decode(data[0]["b64_json"])
        name = f"generated_image_{secrets.token_hex(4)}.png"
        if ctx.env is not None:
            await asyncio.to_thread(ctx.env.write_file, name, image)
            path = name
        else:
            path = os.path.join(tempfile.mkdtemp(prefix="generated-images-"), name)
            with open(path, "wb") as fh:
                fh.write(image)
        return {"image_url": path, "saved_to": path, "backend": "openai", "model": model}
    raise ValueError("the images endpoint returned neither url nor b64_json")


async def image_generate(args: dict, ctx: ToolContext) -> dict:
    import httpx

    prompt = str(args.get("prompt") or "").strip()
    if not prompt:
        return {"error": "prompt must not be empty"}
    aspect = args.get("aspect_ratio") or "landscape"
    if aspect not in ASPECT_RATIOS:
        return {"error": f"aspect_ratio must be one of {', '.join(ASPECT_RATIOS)}"}
    image_url = args.get("image_url") or None
    references = [u for u in args.get("reference_image_urls") or [] if isinstance(u, str) and u]
    backend = image_backend(ctx.settings)
    if backend is None:
        return {"error": _unavailable(ctx.settings)}
    try:
        async with httpx.AsyncClient(timeout=HTTP_TIMEOUT) as client:
            if backend == "fal":
                result = await _fal(client, ctx.settings, prompt, aspect, image_url, references)
            else:
                result = await _openai(client, ctx, prompt, aspect)
                if image_url or references:
                    result["note"] = "input images are not supported by this backend; generated from the prompt only"
    except httpx.HTTPStatusError as exc:
        return {"error": f"{backend} image generation failed: HTTP {exc.response.status_code}: {exc.response.text[:300]}"}
    except (httpx.HTTPError, ValueError, OSError) as exc:
        return {"error": f"{backend} image generation failed: {type(exc).__name__}: {exc}"}
    return {**result, "aspect_ratio": aspect}


TOOLS = [
    ToolSpec(
        name="image_generate",
        toolset="image_gen",
        description=(
            "Create an image from a text description and return its URL. Optionally start from an "
            "existing image or give reference images to guide the style or content."
        ),
        parameters={
            "type": "object",
            "properties": {
                "prompt": {"type": "string", "description": "A detailed description of the image to create."},
                "aspect_ratio": {
                    "type": "string",
                    "enum": list(ASPECT_RATIOS),
                    "description": "Shape of the image (default landscape).",
                },
                "image_url": {"type": "string", "description": "An image to transform instead of starting from scratch."},
                "reference_image_urls": {
                    "type": "array",
                    "items": {"type": "string"},
                    "description": "Images whose style or subject should guide the result.",
                },
            },
            "required": ["prompt"],
        },
        handler=image_generate,
        check=_unavailable,  # the backend chosen, or the first configured
    )
]
