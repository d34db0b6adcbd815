"""The inference HTTP API on a tiny Qwen3-VL (real HTTP on 127.0.0.1, the embedded backend in this process):
images on /v1/completions (base64) and in chat content parts (data URLs) are decoded, checked and sampled with,
and a bad image, too many, a prompt whose image tokens do not match its images or a text-only model are each a
400 naming the problem, for that request alone."""

from __future__ import annotations

import base64
import json
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import pytest
import torch

from config.model import ModelConfig
from engines.inference.embedded.backend import EmbeddedBackend
from engines.inference.embedded.engine import Engine
from engines.inference.frontend import Settings, build_app
from engines.models.decoder import CausalLM
from engines.models.tokenizer import CharTokenizer, HFTokenizer
from engines.protocol import MAX_IMAGE_BASE64, MAX_IMAGES
from tests.vlm_fixture import MAX_SEQ_LEN, load, png, prompt, reference_logprobs, tiny_vlm_dir, token  # noqa: F401 (a fixture)

LONG = 480  # tokens of the good request: it runs while the bad ones are answered


@contextmanager
def serving(model, tokenizer) -> Iterator[httpx.Client]:
    """The front end over an embedded engine on `model`, served by uvicorn on a free loopback port."""
    import uvicorn

    engine = Engine(model, 0, tokenizer.eos_id, tokenizer.pad_id, max_batch_size=8, seed=0)
    app = build_app(EmbeddedBackend(engine, tokenizer, "tiny", None, "", fixed=True), Settings("token"))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the server did not start in 30 s"
        time.sleep(0.05)
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60) as client:
            yield client
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        engine.stop()


@pytest.fixture(scope="module")
def vlm(tiny_vlm_dir):  # noqa: F811 (the fixture)
    model = load(tiny_vlm_dir)
    with serving(model, HFTokenizer(tiny_vlm_dir)) as client:
        yield client, model


def blank_png(width: int, height: int) -> bytes:
    import io

    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", (width, height)).save(out, "PNG")
    return out.getvalue()


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def test_bad_images_are_400s_for_that_request_alone(vlm):
    client, model = vlm
    red = png(1)
    big = blank_png(4097, 4097)  # small as a PNG, over the pixel bound once decoded
    good = {"prompt": prompt("ok", [red]), "images": [b64(red)], "n": 2, "max_tokens": LONG, "ignore_eos": True,
            "logprobs": 0, "return_token_ids": True, "seed": 5}  # fmt: skip
    out: dict = {}
    running = threading.Thread(target=lambda: out.update(r=client.post("/v1/completions", json=good)))
    running.start()
    time.sleep(0.3)  # it is in the batch
    bad = {
        "not valid base64": {"images": ["not base64!"]},
        "not a readable image": {"images": [b64(b"not an image at all")]},
        "over the limit of": {"images": [b64(big)], "prompt": prompt("ok", [red])},  # the pixel bound
        "do not match its images": {"prompt": prompt("ok", [red, red])},  # two image runs, one image
        "at most 8 items": {"images": [b64(red)] * (MAX_IMAGES + 1)},
        f"at most {MAX_IMAGE_BASE64} characters": {"images": ["A" * (MAX_IMAGE_BASE64 + 4)]},  # before decoding
        "token-id prompt": {"prompt": "text with an image"},
    }
    t0 = time.monotonic()
    for needle, change in bad.items():
        body = {"prompt": prompt("ok", [red]), "images": [b64(red)], "max_tokens": 4, **change}
        r = client.post("/v1/completions", json=body)
        assert r.status_code == 400 and needle in r.json()["error"]["message"], (needle, r.text)
    no_images = client.post("/v1/completions", json={"prompt": prompt("ok", [red]), "max_tokens": 4})
    assert no_images.status_code == 400 and "do not match" in no_images.text, no_images.text
    chat = client.post("/v1/chat/completions", json={"messages": [user(image_part("https://example.com/a.png"))]})
    assert chat.status_code == 400 and "must be a data URL" in chat.text, chat.text
    chat = client.post("/v1/chat/completions", json={"messages": [user(image_part(DATA + "AAAA"))]})
    assert chat.status_code == 400 and "images[0]: not a readable image" in chat.text, chat.text
    assert running.is_alive(), "the good request ended before the bad ones were answered: nothing was shared"
    print(f"the refusals took {time.monotonic() - t0:.2f} s while the good request ran")
    running.join(timeout=120)
    r = out["r"]
    assert r.status_code == 200, r.text
    for choice in r.json()["choices"]:  # sampled with its image: the model's own logprobs
        assert len(choice["token_ids"]) == LONG
        ref = reference_logprobs(model, good["prompt"], [red], choice["token_ids"])
        gap = max(abs(a - b) for a, b in zip(choice["logprobs"]["token_logprobs"], ref, strict=True))
        assert gap < 1e-5, gap


DATA = "data:image/png;base64,"


def image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def user(*parts: dict) -> dict:
    return {"role": "user", "content": list(parts)}


def test_chat_content_parts_with_images_render_as_the_completions_prompt(vlm):
    """OpenAI content parts: the chat template writes each image's placeholder, the server widens it to the
    image's tokens; the prompt is the one the orchestrator sends to /v1/completions, sampled with its images."""
    client, model = vlm
    red, green = png(1), png(3, 96, 64)
    parts = [image_part(DATA + b64(red)), image_part(DATA + b64(green)), {"type": "text", "text": "two"}]
    body = {"messages": [user(*parts)], "max_tokens": 6, "logprobs": True, "return_token_ids": True, "seed": 1}
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["prompt_token_ids"] == prompt("two", [red, green])
    tokens = out["choices"][0]["token_ids"]
    ref = reference_logprobs(model, out["prompt_token_ids"], [red, green], tokens)
    got = [lp["logprob"] for lp in out["choices"][0]["logprobs"]["content"]]
    assert max(abs(a - b) for a, b in zip(got, ref, strict=True)) < 1e-5


def test_a_streamed_image_request_draws_what_the_unstreamed_one_draws(vlm):
    client, _ = vlm
    images = [png(4), png(5, 64, 96)]
    body = {"prompt": prompt("s", images), "images": list(map(b64, images)), "max_tokens": 8, "seed": 7,
            "return_token_ids": True}  # fmt: skip
    whole = client.post("/v1/completions", json=body)
    assert whole.status_code == 200, whole.text
    streamed = []
    with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                streamed += json.loads(line.removeprefix("data: "))["choices"][0]["token_ids"]
    assert streamed == whole.json()["choices"][0]["token_ids"]


def test_the_inference_process_serves_a_vlm_publication(tiny_vlm_dir, tmp_path):  # noqa: F811 (the fixture)
    """`python -m engines.inference` on a committed publication of the tiny VLM (as the trainer publishes it):
    an image request is sampled with the published weights and its images."""
    from engines.models import modeldir
    from storage import weights
    from storage.fs import get_fs
    from tests.inference_fixture import serving as process

    mc = ModelConfig(path=str(tiny_vlm_dir), impl="hf", max_seq_len=MAX_SEQ_LEN)
    torch.manual_seed(3)
    loaded = modeldir.load(mc, pretrained=False)  # fresh weights: not the directory's
    fs, root = get_fs(str(tmp_path))
    weights.publish(fs, root, 0, loaded.model.publishable_state_dict(), loaded.publication_files())
    images = [png(6)]
    body = {"prompt": prompt("p", images), "images": list(map(b64, images)), "max_tokens": 8, "logprobs": 0,
            "return_token_ids": True}  # fmt: skip
    with process(str(tmp_path), mc) as client:
        r = client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    ref = reference_logprobs(loaded.model.eval(), body["prompt"], images, choice["token_ids"])
    assert max(abs(a - b) for a, b in zip(choice["logprobs"]["token_logprobs"], ref, strict=True)) < 1e-5


def test_a_text_only_model_refuses_images():
    torch.manual_seed(0)
    tok = CharTokenizer()
    model = CausalLM(ModelConfig(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64),
                     tok.vocab_size)  # fmt: skip
    with serving(model.eval(), tok) as client:
        body = {"prompt": [tok.bos_id, token("a")], "images": [b64(png(1))], "max_tokens": 4}
        r = client.post("/v1/completions", json=body)
        assert r.status_code == 400 and "text-only" in r.json()["error"]["message"], r.text
        assert client.post("/v1/completions", json={**body, "images": None}).status_code == 200
        chat = {"messages": [user(image_part(DATA + b64(png(1))), {"type": "text", "text": "a"})], "max_tokens": 2}
        r = client.post("/v1/chat/completions", json=chat)
        assert r.status_code == 400 and "text-only" in r.json()["error"]["message"], r.text
        chat["messages"] = [user({"type": "text", "text": "a"}, {"type": "text", "text": "b"})]
        r = client.post("/v1/chat/completions", json={**chat, "return_token_ids": True})  # text parts: text
        assert r.status_code == 200 and r.json()["prompt_token_ids"] == tok.render_messages(
            [{"role": "user", "content": "ab"}]
        )
