"""Loading images from what users send: PIL images, local paths, data: URLs, file:// and http(s) URLs.

The server is strict (a `MediaPolicy` built from its flags): data: URLs always; file:// only under
--allowed-local-media-path; http(s) only for hosts in --allowed-media-domains, with a timeout and a
size cap. The offline API trusts its caller: paths and file:// are fine there, the network is not.
Every failure is a `MediaError` whose message says what was wrong (the server turns it into a 400).
"""
from __future__ import annotations

import asyncio
import base64
import binascii
import io
import json
import os
import urllib.parse
from dataclasses import dataclass

from splitserve.arg_utils import CliOptions, option

DEFAULT_MAX_IMAGE_BYTES = 20 << 20        # encoded size
DEFAULT_MAX_IMAGE_PIXELS = 40_000_000    # decoded size (a decompression bomb is small on the wire)
DEFAULT_FETCH_TIMEOUT_S = 10.0
DEFAULT_LIMIT_PER_PROMPT = 4


class MediaError(ValueError):
    """Bad or disallowed media in a request; the message is meant for the client."""


@dataclass(frozen=True)
class MediaPolicy:
    allow_paths: bool = False                 # plain local paths (offline API only)
    allowed_local_media_path: str | None = None  # file:// URLs must resolve under this directory
    allowed_media_domains: tuple[str, ...] = ()   # http(s) hosts that may be fetched
    fetch_timeout_s: float = DEFAULT_FETCH_TIMEOUT_S
    max_image_bytes: int = DEFAULT_MAX_IMAGE_BYTES
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS
    limit_per_prompt: int | None = DEFAULT_LIMIT_PER_PROMPT

    @classmethod
    def offline(cls) -> "MediaPolicy":
        return cls(allow_paths=True, allowed_local_media_path="/", limit_per_prompt=None)

    @classmethod
    def from_args(cls, args) -> "MediaPolicy":
        """From the server's parsed flags (`MediaArgs`); absent ones (or no `args`) take their defaults."""
        a = MediaArgs.from_namespace(args)
        local = a.allowed_local_media_path
        return cls(allowed_local_media_path=os.path.realpath(local) if local else None,
                   allowed_media_domains=tuple(d.lower() for d in a.allowed_media_domains or ()),
                   fetch_timeout_s=a.media_fetch_timeout,
                   limit_per_prompt=parse_limit_mm_per_prompt(a.limit_mm_per_prompt))


def parse_limit_mm_per_prompt(text: str | int | None) -> int:
    """`image=2`, `{"image": 2}` or `2` -> 2 (images are the only modality)."""
    if text is None:
        return DEFAULT_LIMIT_PER_PROMPT
    if isinstance(text, int):
        value = text
    else:
        text = text.strip()
        try:
            if text.startswith("{"):
                value = json.loads(text)["image"]
            elif "=" in text:
                key, _, num = text.partition("=")
                if key.strip() != "image":
                    raise KeyError(key)
                value = int(num)
            else:
                value = int(text)
        except (ValueError, KeyError, TypeError):
            raise ValueError(f"--limit-mm-per-prompt should look like image=2 or '{{\"image\": 2}}', got {text!r}") from None
    if not isinstance(value, int) or value < 0:
        raise ValueError(f"--limit-mm-per-prompt must be a non-negative integer, got {value!r}")
    return value


@dataclass
class MediaArgs(CliOptions):
    """The server's flags that build its MediaPolicy (`MediaPolicy.from_args` reads them)."""
    limit_mm_per_prompt: str | None = option(
        None, default_text=f"image={DEFAULT_LIMIT_PER_PROMPT}",
        help="most images in one request: image=N, '{\"image\": N}' or N")
    allowed_local_media_path: str | None = option(
        None, default_text="none", help="let requests read file:// image URLs under this directory")
    allowed_media_domains: list[str] | None = option(
        None, default_text="none; http(s) image URLs are refused",
        help="hosts whose http(s) image URLs may be fetched")
    media_fetch_timeout: float = option(DEFAULT_FETCH_TIMEOUT_S, help="seconds allowed to fetch one http(s) image")

    @classmethod
    def cli_title(cls) -> str:
        return "media options"


# -- decoding ----------------------------------------------------------------------------------------
def decode_image_bytes(data: bytes, policy: MediaPolicy, what: str = "image"):
    from PIL import Image
    if len(data) > policy.max_image_bytes:
        raise MediaError(f"{what} is {len(data)} bytes; the limit is {policy.max_image_bytes} bytes")
    try:
        img = Image.open(io.BytesIO(data))
        w, h = img.size
        if w * h > policy.max_image_pixels:
            raise MediaError(f"{what} is {w}x{h} pixels; the limit is {policy.max_image_pixels} pixels")
        img.load()
    except MediaError:
        raise
    except Exception as e:  # PIL raises many types (UnidentifiedImageError, OSError, DecompressionBomb...)
        raise MediaError(f"{what} could not be decoded as an image ({type(e).__name__}: {e})") from None
    return img.convert("RGB")


def _check_pil(img, policy: MediaPolicy):
    w, h = img.size
    if w * h > policy.max_image_pixels:
        raise MediaError(f"image is {w}x{h} pixels; the limit is {policy.max_image_pixels} pixels")
    if w < 1 or h < 1:
        raise MediaError(f"image has an empty size {w}x{h}")
    return img if img.mode == "RGB" else img.convert("RGB")


def _decode_data_url(url: str, policy: MediaPolicy):
    header, sep, payload = url.partition(",")
    if not sep or not header.startswith("data:"):
        raise MediaError("malformed data: URL (expected data:image/<type>;base64,<data>)")
    if not header.endswith(";base64"):
        raise MediaError("data: URLs must be base64-encoded (data:image/<type>;base64,...)")
    if len(payload) > policy.max_image_bytes * 4 // 3 + 4:
        raise MediaError(f"image data is larger than the limit of {policy.max_image_bytes} bytes")
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise MediaError("data: URL payload is not valid base64") from None
    return decode_image_bytes(data, policy, "data: URL image")


def read_local_bytes(path: str, policy: MediaPolicy, what: str, max_bytes: int) -> bytes:
    """A local file's bytes, if it lies under the allowed local media path and within max_bytes."""
    root = policy.allowed_local_media_path
    real = os.path.realpath(path)
    if root is None:
        raise MediaError("local files are not allowed; start the server with --allowed-local-media-path DIR")
    if root != "/" and os.path.commonpath([real, root]) != root:
        raise MediaError(f"{what} is outside the allowed local media path")
    try:
        size = os.path.getsize(real)
        if size > max_bytes:
            raise MediaError(f"{what} is {size} bytes; the limit is {max_bytes} bytes")
        with open(real, "rb") as f:
            return f.read()
    except OSError as e:
        raise MediaError(f"{what} could not be read ({e.strerror or e})") from None


def _read_local(path: str, policy: MediaPolicy, what: str):
    return decode_image_bytes(read_local_bytes(path, policy, what, policy.max_image_bytes), policy, what)


def _check_host(url: str, policy: MediaPolicy) -> None:
    host = (urllib.parse.urlsplit(url).hostname or "").lower()
    if not policy.allowed_media_domains:
        raise MediaError("http(s) image URLs are not allowed on this server; send the image as a "
                         "base64 data: URL (or start the server with --allowed-media-domains)")
    if host not in policy.allowed_media_domains:
        raise MediaError(f"image host {host!r} is not in --allowed-media-domains")


async def fetch_http_image(url: str, policy: MediaPolicy, executor=None):
    """Downloads an allowed http(s) image, stopping as soon as it passes the size cap."""
    import httpx
    _check_host(url, policy)
    try:
        async with httpx.AsyncClient(timeout=policy.fetch_timeout_s, follow_redirects=False) as client:
            async with client.stream("GET", url) as resp:
                if resp.status_code != 200:
                    raise MediaError(f"fetching the image failed with HTTP {resp.status_code}")
                buf = bytearray()
                async for chunk in resp.aiter_bytes():
                    buf += chunk
                    if len(buf) > policy.max_image_bytes:
                        raise MediaError(f"remote image is larger than the limit of {policy.max_image_bytes} bytes")
                data = bytes(buf)
    except MediaError:
        raise
    except httpx.TimeoutException:
        raise MediaError(f"fetching the image timed out after {policy.fetch_timeout_s} s") from None
    except httpx.HTTPError as e:
        raise MediaError(f"fetching the image failed ({type(e).__name__})") from None
    # Decoding is CPU work: off the loop, on the caller's pool (None: the loop's default executor).
    return await asyncio.get_running_loop().run_in_executor(executor, decode_image_bytes, data, policy, "remote image")


def load_image(source, policy: MediaPolicy):
    """A PIL image (RGB) from a PIL image, a path, or a data:/file:// URL. http(s) needs the async
    `fetch_http_image` (the server) and is refused here."""
    from PIL import Image
    if isinstance(source, Image.Image):
        return _check_pil(source, policy)
    if isinstance(source, dict):  # {"url": ...} as in OpenAI's image_url part
        source = source.get("url")
    if isinstance(source, os.PathLike):
        source = os.fspath(source)
    if not isinstance(source, str) or not source:
        raise MediaError(f"an image must be a PIL image, a path or a URL, got {type(source).__name__}")
    if source.startswith("data:"):
        return _decode_data_url(source, policy)
    if source.startswith("file://"):
        path = urllib.parse.unquote(urllib.parse.urlsplit(source).path)
        return _read_local(path, policy, "file:// image")
    if source.startswith(("http://", "https://")):
        _check_host(source, policy)
        raise MediaError("http(s) images can only be fetched by the server")
    if "://" in source:
        raise MediaError(f"unsupported image URL scheme in {source[:32]!r} (use data:, file:// or http(s))")
    if not policy.allow_paths:
        raise MediaError("image_url must be a data:, file:// or http(s) URL")
    return _read_local(source, policy, f"image file {source!r}")

