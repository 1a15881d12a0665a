"""vision_analyze, mixture_of_agents and image_generate against the local model server."""

from __future__ import annotations

import asyncio
import base64
import os
import shutil

import pytest

from agent.model_client import ModelClient, RetryPolicy, SessionModel
from tests.helpers.model_server import ModelServer, error_reply
from tests.helpers.web_fixtures import BLUE_PNG, RED_PNG, DirEnv, FixtureSite, make_ctx
from tools import image_generation_tool as imagegen
from tools import mixture_of_agents_tool as moa
from tools import vision_tools
from tools.registry import unavailable_reason
from tools.settings import ToolSettings


def failing_models(body: dict, state):
    """Reference models named bad/... answer HTTP 400 (not retried); the rest follow the script."""
    if str(body.get("model", "")).startswith("bad/"):
        return error_reply(400, "this model refuses")
    return None


@pytest.fixture(scope="module")
def server():
    with ModelServer(latency=0.0, policy=failing_models) as server:
        yield server


@pytest.fixture
def model_server(server):
    server.reset()
    return server


@pytest.fixture(scope="module")
def site():
    with FixtureSite() as site:
        yield site


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for name in ("FAL_KEY", "IMAGES_BASE_URL", "IMAGES_API_KEY"):
        monkeypatch.delenv(name, raising=False)


def call(server: ModelServer, handler, args: dict, settings: ToolSettings, env=None) -> dict:
    async def go():
        client = ModelClient(server.base_url, "test-key", policy=RetryPolicy(max_attempts=1, request_timeout=30))
        try:
            return await handler(args, make_ctx(settings, model=SessionModel(client, settings.model), env=env))
        finally:
            await client.close()

    return asyncio.run(go())


def chat_requests(server: ModelServer) -> list:
    return [r for r in server.requests if r.path.endswith("/chat/completions")]


# ---------------------------------------------------------------- vision_analyze


def test_vision_local_file_becomes_data_url(model_server, tmp_path):
    (tmp_path / "shots").mkdir()
    (tmp_path / "shots" / "chart").write_bytes(RED_PNG)  # no extension: the type comes from the bytes
    settings = ToolSettings(model="run-model", vision_model="vision-model")
    args = {"image_url": "shots/chart", "question": "What is shown?"}
    result = call(model_server, vision_tools.vision_analyze, args, settings, env=DirEnv(tmp_path))
    assert result["analysis"]
    (request,) = chat_requests(model_server)
    assert request.body["model"] == "vision-model"
    (message,) = request.body["messages"]
    assert message["role"] == "user"
    text, image = message["content"]
    assert text == {"type": "text", "text": "What is shown?"}
    url = image["image_url"]["url"]
    assert image["type"] == "image_url" and url.startswith("data:image/png;base64,")
    assert base64.b64decode(url.split(",", 1)[1]) == RED_PNG


def test_vision_host_fallback_http_url_and_default_model(model_server, tmp_path):
    host_file = tmp_path / "photo.jpg"
    host_file.write_bytes(b"\xff\xd8\xff\xe0" + b"\x00" * 64)
    settings = ToolSettings(model="run-model")
    empty_env = DirEnv(tmp_path / "empty-workdir")  # the file is not in the environment
    call(model_server, vision_tools.vision_analyze, {"image_url": str(host_file), "question": "q"}, settings, empty_env)
    call(model_server, vision_tools.vision_analyze, {"image_url": "https://img.example/x.png", "question": "q"}, settings)
    local, remote = chat_requests(model_server)
    assert local.body["model"] == "run-model"  # no vision_model: the run's model
    assert local.body["messages"][0]["content"][1]["image_url"]["url"].startswith("data:image/jpeg;base64,")
    assert remote.body["messages"][0]["content"][1]["image_url"]["url"] == "https://img.example/x.png"


def test_vision_errors(model_server, tmp_path):
    (tmp_path / "notes.txt").write_text("not an image")
    settings = ToolSettings(model="run-model")
    env = DirEnv(tmp_path)
    missing = call(model_server, vision_tools.vision_analyze, {"image_url": "nope.png", "question": "q"}, settings, env)
    assert "not found" in missing["error"]
    text = call(model_server, vision_tools.vision_analyze, {"image_url": "notes.txt", "question": "q"}, settings, env)
    assert "not a PNG" in text["error"]
    refused = call(model_server, vision_tools.vision_analyze, {"image_url": "https://x/y.png", "question": "q"},
                   settings.model_copy(update={"vision_model": "bad/vision"}))
    assert "bad/vision" in refused["error"] and "refuses" in refused["error"]
    assert chat_requests(model_server)[-1].body["model"] == "bad/vision"


# ---------------------------------------------------------------- mixture_of_agents


def test_moa_asks_every_reference_then_the_aggregator(model_server):
    settings = ToolSettings(model="run-model", moa_reference_models=["ref/a", "ref/b", "ref/c"],
                            moa_aggregator_model="agg/z")
    result = call(model_server, moa.mixture_of_agents, {"user_prompt": "Is 97 prime?"}, settings)
    assert result["response"] and result["models_used"] == ["ref/a", "ref/b", "ref/c"]
    assert result["aggregator_model"] == "agg/z" and result["failed_models"] == []
    requests = chat_requests(model_server)
    assert sorted(r.body["model"] for r in requests[:3]) == ["ref/a", "ref/b", "ref/c"]
    assert requests[3].body["model"] == "agg/z" and len(requests) == 4
    for r in requests[:3]:
        assert r.body["messages"] == [{"role": "user", "content": "Is 97 prime?"}]
    aggregation = requests[3].body["messages"][0]["content"]
    assert "Is 97 prime?" in aggregation and "### Answer 3" in aggregation and "### Answer 4" not in aggregation


def test_moa_tolerates_failures_but_not_all(model_server):
    settings = ToolSettings(model="run-model", moa_reference_models=["ref/a", "bad/b", "ref/c"],
                            moa_aggregator_model="agg/z")
    result = call(model_server, moa.mixture_of_agents, {"user_prompt": "p"}, settings)
    assert result["models_used"] == ["ref/a", "ref/c"]
    assert [f["model"] for f in result["failed_models"]] == ["bad/b"]
    assert "### Answer 3" not in chat_requests(model_server)[-1].body["messages"][0]["content"]

    all_bad = settings.model_copy(update={"moa_reference_models": ["bad/1", "bad/2"]})
    result = call(model_server, moa.mixture_of_agents, {"user_prompt": "p"}, all_bad)
    assert "every reference model failed" in result["error"] and len(result["failed_models"]) == 2

    bad_aggregator = settings.model_copy(update={"moa_aggregator_model": "bad/agg"})
    assert "bad/agg" in call(model_server, moa.mixture_of_agents, {"user_prompt": "p"}, bad_aggregator)["error"]


# ---------------------------------------------------------------- image_generate


def test_image_generate_openai_compatible_endpoint(model_server):
    settings = ToolSettings(images_base_url=model_server.base_url, image_model="img-model", images_api_key="ik")
    args = {"prompt": "a lighthouse at dusk", "aspect_ratio": "portrait"}
    result = call(model_server, imagegen.image_generate, args, settings)
    assert result["backend"] == "openai" and result["aspect_ratio"] == "portrait"
    assert result["image_url"].startswith(model_server.root_url + "/img/")
    (request,) = [r for r in model_server.requests if r.path == "/v1/images/generations"]
    assert request.body == {"model": "img-model", "prompt": "a lighthouse at dusk", "size": "1024x1536", "n": 1}
    assert request.headers["authorization"] == "Bearer ik"
    assert "error" in call(model_server, imagegen.image_generate, {"prompt": "x", "aspect_ratio": "wide"}, settings)


def test_image_generate_b64_answer_is_saved_in_the_environment(model_server, site, tmp_path):
    settings = ToolSettings(images_base_url=site.url("/b64"))
    result = call(model_server, imagegen.image_generate, {"prompt": "p"}, settings, env=DirEnv(tmp_path))
    assert result["backend"] == "openai" and result["saved_to"] == result["image_url"]
    assert (tmp_path / result["saved_to"]).read_bytes() == BLUE_PNG
    assert site.requests_to("/b64/images/generations")[-1].body["size"] == "1536x1024"  # landscape default

    without_env = call(model_server, imagegen.image_generate, {"prompt": "p"}, settings)  # no environment: host file
    with open(without_env["saved_to"], "rb") as fh:
        assert fh.read() == BLUE_PNG
    shutil.rmtree(os.path.dirname(without_env["saved_to"]))


def test_image_generate_fal(model_server, site, monkeypatch):
    monkeypatch.setattr(imagegen, "FAL_BASE_URL", site.url("/fal"))
    monkeypatch.setenv("FAL_KEY", "fal-secret")
    settings = ToolSettings(images_base_url=model_server.base_url)  # both configured: fal comes first
    args = {"prompt": "p", "aspect_ratio": "square", "reference_image_urls": ["https://r.example/1.png"]}
    result = call(model_server, imagegen.image_generate, args, settings)
    assert result == {"image_url": site.url("/img/red.png"), "backend": "fal", "model": "fal-ai/flux/schnell",
                      "aspect_ratio": "square"}
    request = site.requests_to("/fal/fal-ai/flux/schnell")[-1]
    assert request.headers["authorization"] == "Key fal-secret"
    assert request.body["image_size"] == "square_hd" and request.body["image_urls"] == ["https://r.example/1.png"]
    chosen = settings.model_copy(update={"image_backend": "openai"})
    assert call(model_server, imagegen.image_generate, {"prompt": "p"}, chosen)["backend"] == "openai"


# ---------------------------------------------------------------- availability


def test_unavailable_reasons_without_configuration():
    assert "FAL_KEY or IMAGES_BASE_URL" in imagegen._unavailable(ToolSettings())
    assert "FAL_KEY" in imagegen._unavailable(ToolSettings(image_backend="fal", images_base_url="http://x"))
    assert imagegen._unavailable(ToolSettings(fal_key="k")) is None
    vision, = vision_tools.TOOLS
    assert unavailable_reason(vision, ToolSettings(model="")) == "no model configured for vision"
    assert unavailable_reason(vision, ToolSettings(model="", vision_model="v")) is None
    assert unavailable_reason(vision, ToolSettings(model="m")) is None
    assert unavailable_reason(moa.TOOLS[0], ToolSettings(model="")) == "no model configured"
    assert unavailable_reason(moa.TOOLS[0], ToolSettings(model="m")) is None
