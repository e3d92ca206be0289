"""The server's media pool (entrypoints/openai/serving_mm.py): a request's images are decoded and
preprocessed on worker threads, never on the event loop, so /health answers while a large batch of
images decodes; a bad image among many is the request's 400 and ends no other work early."""
from __future__ import annotations

import asyncio
import base64
import io
import threading

import numpy as np
import pytest
from fastapi import FastAPI
from fastapi.responses import JSONResponse

from splitserve.entrypoints.openai.protocol import APIError
from splitserve.entrypoints.openai.serving_mm import MediaPool, build_chat_prompt
from splitserve.multimodal.media import MediaPolicy


def png_data_url(seed: int, side: int) -> str:
    from PIL import Image
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (side, side, 3), dtype=np.uint8)).save(buf, "PNG", compress_level=1)
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


class RecordingProcessor:
    """The slice of MultiModalProcessor the server calls, recording the threads each step ran on."""

    def __init__(self):
        self.threads: list[str] = []

    def check_count(self, n, policy):
        pass

    def process_media(self, img):
        self.threads.append(threading.current_thread().name)
        return img.size

    def chat_prompt_from_text(self, text, images):
        self.threads.append(threading.current_thread().name)
        return images


def app_with(mm, pool: MediaPool, sources: list) -> FastAPI:
    app = FastAPI()

    @app.get("/health")
    async def health():
        return JSONResponse({"ok": True})

    @app.post("/images")
    async def images():
        try:
            sizes = await build_chat_prompt(mm, MediaPolicy(limit_per_prompt=None), "text", sources, pool)
        except APIError as e:
            return JSONResponse({"error": e.message}, status_code=e.status)
        return JSONResponse({"sizes": sizes})

    return app


def test_health_answers_while_a_batch_of_images_decodes():
    import httpx
    sources = [png_data_url(i, 768) for i in range(16)]  # 1.7 MB of PNG each
    mm, pool = RecordingProcessor(), MediaPool(2)

    async def main():
        transport = httpx.ASGITransport(app=app_with(mm, pool, sources))
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            batch = asyncio.create_task(client.post("/images"))
            answered = 0
            while not batch.done():
                r = await client.get("/health")
                assert r.status_code == 200
                answered += 1
                await asyncio.sleep(0.01)  # a client's pace, not a busy loop
            return (await batch), answered

    try:
        resp, answered = asyncio.run(main())
    finally:
        pool.shutdown()
    assert resp.status_code == 200 and resp.json()["sizes"] == [[768, 768]] * len(sources)
    # Every image was decoded and preprocessed, and the prompt built, on the pool's threads.
    assert len(mm.threads) == len(sources) + 1
    assert all(name.startswith("splitserve-media") for name in mm.threads), set(mm.threads)
    # The loop stayed free: health requests kept being answered while the batch decoded (decoding
    # 16 such images takes hundreds of milliseconds; on the loop it would admit none of them).
    assert answered >= 3, answered


def test_a_bad_image_among_many_is_the_requests_400():
    sources = [png_data_url(i, 64) for i in range(5)]
    sources.insert(2, "data:image/png;base64,bm90IGFuIGltYWdl")  # "not an image"
    mm, pool = RecordingProcessor(), MediaPool(2)
    try:
        with pytest.raises(APIError) as err:
            asyncio.run(build_chat_prompt(mm, MediaPolicy(limit_per_prompt=None), "t", sources, pool))
    finally:
        pool.shutdown()
    assert err.value.status == 400 and "could not be decoded" in err.value.message
    assert len(mm.threads) == 5  # the others still ran to their end (nothing left running behind the answer)
