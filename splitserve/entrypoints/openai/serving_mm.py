"""Image content parts of chat requests: fetch/decode under the server's media policy, preprocess,
and build the prompt. Every media problem is a 400 with the reason.

Decoding (base64, PIL), preprocessing and tokenizing run on the server's media pool (`MediaPool`),
never on the event loop: a batch of large images must not delay /health or other requests' tokens.
A request's images decode in parallel (PIL's decoders and torch's ops release the GIL)."""
from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from functools import partial

from splitserve.entrypoints.openai.protocol import APIError
from splitserve.protocol.mm_inputs import MultiModalPrompt
from splitserve.multimodal.media import MediaError, MediaPolicy, fetch_http_image, load_image
from splitserve.multimodal.processor import (IMAGE_PART_TYPES, VIDEO_PART_TYPES, MultiModalProcessor,
                                             image_part_source, video_part_source)
from splitserve.multimodal.video import VideoRef
from splitserve.cpu_limits import usable_cpus


class MediaPool:
    """Worker threads of the API server for media work; one per usable CPU (at most 16)."""

    def __init__(self, workers: int | None = None):
        self.workers = workers or max(2, min(16, usable_cpus()))
        self.executor = ThreadPoolExecutor(self.workers, thread_name_prefix="splitserve-media")

    async def run(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self.executor, partial(fn, *args))

    def shutdown(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)


def chat_image_sources(messages) -> list:
    """The image (and video: VideoRef) sources of a chat request's messages, in order (pydantic
    ChatMessage objects)."""
    sources = []
    for i, m in enumerate(messages):
        if not isinstance(m.content, list):
            continue
        for part in m.content:
            if part.type in IMAGE_PART_TYPES:
                try:
                    sources.append(image_part_source(part.model_dump()))
                except MediaError as e:
                    raise APIError(400, str(e), param=f"messages[{i}].content") from None
            elif part.type in VIDEO_PART_TYPES:
                try:
                    sources.append(VideoRef(video_part_source(part.model_dump())))
                except MediaError as e:
                    raise APIError(400, str(e), param=f"messages[{i}].content") from None
    return sources


async def _load(source, policy: MediaPolicy, mm, pool: MediaPool):
    """One source -> its processed item (decoded and preprocessed on the pool)."""
    if isinstance(source, VideoRef):
        if getattr(mm, "video_marker_id", None) is None:
            raise MediaError("this model does not accept videos")
        media = await pool.run(mm.load_media, source, policy)
    elif isinstance(source, str) and source.startswith(("http://", "https://")):
        media = await fetch_http_image(source, policy, pool.executor)
    else:
        media = await pool.run(load_image, source, policy)
    return await pool.run(mm.process_media if hasattr(mm, "process_media") else mm.process_image, media)


async def _load_all(sources: list, policy: MediaPolicy, mm, pool: MediaPool) -> list:
    """All of a request's items, in parallel, in order; the first failure is raised once all ended
    (no pool work is left running for a request that already answered)."""
    results = await asyncio.gather(*(_load(s, policy, mm, pool) for s in sources), return_exceptions=True)
    for r in results:
        if isinstance(r, BaseException):
            raise r
    return results


async def build_chat_prompt(mm: MultiModalProcessor, policy: MediaPolicy, text: str,
                            sources: list, pool: MediaPool) -> MultiModalPrompt:
    try:
        mm.check_count(len(sources), policy)
        images = await _load_all(sources, policy, mm, pool)
        # Tokenizing the rendered text is CPU work too, and it can be megabytes.
        return await pool.run(mm.chat_prompt_from_text, text, images)
    except MediaError as e:
        raise APIError(400, str(e), param="messages") from None


async def build_messages_prompt(mm, policy: MediaPolicy, messages: list[dict], sources: list,
                                pool: MediaPool) -> MultiModalPrompt:
    """For a processor that builds its prompt from the messages themselves (`chat_prompt_from_messages`:
    encoder-decoder models such as Pix2Struct, whose text is not a chat-templated decoder prompt)."""
    try:
        mm.check_count(len(sources), policy)
        images = await _load_all(sources, policy, mm, pool)
        return await pool.run(mm.chat_prompt_from_messages, messages, images)
    except MediaError as e:
        raise APIError(400, str(e), param="messages") from None
