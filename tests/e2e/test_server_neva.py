"""A `.nemo` archive behind `splitserve serve`, driven by the official `openai` client: a video file
(made here with PyAV) as a data: URL and as a file:// URL beside an image; the expected replies come
from the independent reference in tests/neva_reference.py. Bad videos and placeholder-only token
prompts are 400s."""
from __future__ import annotations

import base64

import httpx
import openai
import pytest

from tests.e2e.conftest import DEFAULT_ARGS, ServerProcess
from tests.e2e.test_server_vlm import data_url
from tests.models.test_neva import COLORS, neva_tokenizer
from tests.multimodal_reference import random_image
from tests.neva_reference import (NVGPT_SYSTEM, ReferenceNeva, make_clip, make_decoder, make_projector, model_config,
                                  nemo_state_dict, read_video_frames, write_clip_dir, write_nemo, write_video)

MAX_TOKENS = 5
FRAMES = 3  # --num-frames (the archive's config says 4)


@pytest.fixture(scope="module")
def neva(tmp_path_factory):
    root = tmp_path_factory.mktemp("neva-server")
    tok = neva_tokenizer()
    vocab = (len(tok) + 127) // 128 * 128
    dec, clip, proj = make_decoder(vocab, 11), make_clip(12), make_projector(13)
    write_clip_dir(str(root / "clip-tiny"), clip)
    nemo = write_nemo(str(root / "neva-tiny.nemo"), model_config("clip-tiny", num_frames=4), nemo_state_dict(dec, proj), tok)
    video = write_video(str(root / "clip.mp4"), COLORS[:7], seed=2)
    srv = ServerProcess(DEFAULT_ARGS + [nemo, "--max-model-len", "1024", "--num-frames", str(FRAMES),
                                        "--allowed-local-media-path", str(root)],
                        env={"SPLITSERVE_CACHE_DIR": str(root / "cache")})
    try:
        srv.wait_healthy()
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        yield srv, client, ReferenceNeva(dec, clip, proj, tok), tok, video
    finally:
        srv.stop()


def _prompt(*segments):
    return ([f"<extra_id_0>System\n{NVGPT_SYSTEM}\n\n<extra_id_1>User\n"] + list(segments)
            + ["\n<extra_id_1>Assistant\n"])


def test_video_data_url_through_the_openai_client(neva):
    _, client, ref, tok, video = neva
    with open(video, "rb") as f:
        url = "data:video/mp4;base64," + base64.b64encode(f.read()).decode()
    want, _, ids = ref.greedy(_prompt(("video", read_video_frames(video, FRAMES)), "\nWhat happens in the clip?"),
                              MAX_TOKENS)
    resp = client.chat.completions.create(
        model="neva-tiny.nemo", max_tokens=MAX_TOKENS, temperature=0, extra_body={"ignore_eos": True},
        messages=[{"role": "user", "content": [{"type": "video_url", "video_url": {"url": url}},
                                               {"type": "text", "text": "What happens in the clip?"}]}])
    assert resp.choices[0].message.content == tok.decode(want, skip_special_tokens=True)
    assert resp.usage.prompt_tokens == len(ids)


def test_image_and_file_video_in_one_message(neva):
    _, client, ref, tok, video = neva
    img = random_image(3, (72, 56))
    want, _, ids = ref.greedy(_prompt(("image", img), "\n", ("video", read_video_frames(video, FRAMES)),
                                      "\nCompare them."), MAX_TOKENS)
    resp = client.chat.completions.create(
        model="neva-tiny.nemo", max_tokens=MAX_TOKENS, temperature=0, extra_body={"ignore_eos": True},
        messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(img)}},
                                               {"type": "video_url", "video_url": {"url": "file://" + video}},
                                               {"type": "text", "text": "Compare them."}]}])
    assert resp.choices[0].message.content == tok.decode(want, skip_special_tokens=True)
    assert resp.usage.prompt_tokens == len(ids)


def test_bad_inputs_are_400s(neva):
    srv, client, ref, tok, _ = neva
    bad = "data:video/mp4;base64," + base64.b64encode(b"this is no video").decode()
    with pytest.raises(openai.BadRequestError, match="could not be decoded"):
        client.chat.completions.create(model="neva-tiny.nemo", max_tokens=2, messages=[
            {"role": "user", "content": [{"type": "video_url", "video_url": {"url": bad}}]}])
    with pytest.raises(openai.BadRequestError, match="outside the allowed local media path"):
        client.chat.completions.create(model="neva-tiny.nemo", max_tokens=2, messages=[
            {"role": "user", "content": [{"type": "video_url", "video_url": {"url": "file:///etc/hostname"}}]}])
    r = httpx.post(srv.url + "/v1/completions", timeout=60, json={
        "model": "neva-tiny.nemo", "max_tokens": 2, "prompt": tok.encode("look", add_special_tokens=False) + [ref.placeholder]})
    assert r.status_code == 400 and "no image or video was given" in r.text
    assert httpx.get(srv.url + "/health", timeout=5).status_code == 200
