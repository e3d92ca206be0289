"""Image content parts of chat requests: fetch/decode under the server's media policy, preprocess off
the event loop, and build the prompt. Every media problem is a 400 with the reason."""
from __future__ import annotations

import asyncio

from splitserve.entrypoints.openai.protocol import APIError
from splitserve.protocol.mm_inputs import MultiModalPrompt
from splitserve.multimodal.media import MediaError, MediaPolicy, load_image, load_image_async
from splitserve.multimodal.processor import (IMAGE_PART_TYPES, VIDEO_PART_TYPES, MultiModalProcessor,
                                             image_part_source, video_part_source)
from splitserve.multimodal.video import VideoRef


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


async def _load(source, policy: MediaPolicy, mm=None):
    if isinstance(source, VideoRef):  # decoding is CPU work
        if getattr(mm, "video_marker_id", None) is None:
            raise MediaError("this model does not accept videos")
        return await asyncio.to_thread(mm.load_media, source, policy)
    if isinstance(source, str) and source.startswith(("http://", "https://")):
        return await load_image_async(source, policy)
    return await asyncio.to_thread(load_image, source, policy)  # decoding is CPU work


async def build_chat_prompt(mm: MultiModalProcessor, policy: MediaPolicy, text: str,
                            sources: list) -> MultiModalPrompt:
    try:
        mm.check_count(len(sources), policy)
        images = [await _load(s, policy, mm) for s in sources]
        # Preprocessing is CPU work, and so is tokenizing the rendered text, which can be megabytes.
        return await asyncio.to_thread(lambda: mm.chat_prompt_from_text(text, [mm.process_media(img) for img in images]))
    except MediaError as e:
        raise APIError(400, str(e), param="messages") from None


async def build_messages_prompt(mm, policy: MediaPolicy, messages: list[dict], sources: list) -> MultiModalPrompt:
    """For a processor that builds its prompt from the messages themselves (`chat_prompt_from_messages`:
    encoder-decoder models such as Pix2Struct, whose text is not a chat-templated decoder prompt)."""
    try:
        mm.check_count(len(sources), policy)
        images = [await _load(s, policy, mm) for s in sources]
        return await asyncio.to_thread(lambda: mm.chat_prompt_from_messages(messages, [mm.process_image(img) for img in images]))
    except MediaError as e:
        raise APIError(400, str(e), param="messages") from None
