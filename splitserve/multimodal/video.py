"""Videos from what users send: frames decoded with PyAV and sampled evenly to the model's frame count.

Sources follow the image rules (multimodal/media.py): data: URLs always; file:// under
--allowed-local-media-path; plain paths, bytes and already decoded frames (a [T, H, W, 3] uint8
array or tensor, or a list of PIL images / arrays) in the offline API only; http(s) is refused.
Sampling is Video NeVA's: min(num_frames, T) indices spread evenly over [0, T - 1] (rounded down),
the last frame repeated up to num_frames, so a video always costs num_frames frames of tokens.
Every failure is a MediaError (a 400 in the server).
"""
from __future__ import annotations

import base64
import binascii
import hashlib
import io
import os
import urllib.parse
from dataclasses import dataclass

from splitserve.multimodal.media import MediaError, MediaPolicy, read_local_bytes

DEFAULT_MAX_VIDEO_BYTES = 256 << 20
MAX_DECODED_FRAMES = 100_000  # a stream claiming more is refused before its frames are kept


@dataclass(frozen=True)
class VideoRef:
    """A video content part's source, kept apart from image sources in one ordered media list."""
    source: object


@dataclass
class DecodedVideo:
    frames: list  # PIL RGB images, num_frames of them
    hash: str     # content hash of the sampled frames' pixels


def sample_indices(total: int, num_frames: int) -> list[int]:
    import numpy as np
    n = min(num_frames, total)
    idx = [int(i) for i in np.linspace(0, total - 1, num=n, dtype=int)]
    return idx + [idx[-1]] * (num_frames - n)


def _video_bytes(source, policy: MediaPolicy) -> bytes:
    if isinstance(source, dict):
        source = source.get("url")
    if isinstance(source, (bytes, bytearray, memoryview)):
        if not policy.allow_paths:
            raise MediaError("video_url must be a data: or file:// URL")
        return bytes(source)
    if isinstance(source, os.PathLike):
        source = os.fspath(source)
    if not isinstance(source, str) or not source:
        raise MediaError(f"a video must be a data:/file:// URL, a path, bytes or frames, got {type(source).__name__}")
    if source.startswith("data:"):
        header, sep, payload = source.partition(",")
        if not sep or not header.endswith(";base64"):
            raise MediaError("video data: URLs must be base64-encoded (data:video/<type>;base64,...)")
        if len(payload) > DEFAULT_MAX_VIDEO_BYTES * 4 // 3 + 4:
            raise MediaError(f"video data is larger than the limit of {DEFAULT_MAX_VIDEO_BYTES} bytes")
        try:
            return base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise MediaError("video data: URL payload is not valid base64") from None
    if source.startswith("file://"):
        path = urllib.parse.unquote(urllib.parse.urlsplit(source).path)
        return read_local_bytes(path, policy, "file:// video", DEFAULT_MAX_VIDEO_BYTES)
    if source.startswith(("http://", "https://")):
        raise MediaError("http(s) video URLs are not supported; send the video as a base64 data: URL")
    if "://" in source:
        raise MediaError(f"unsupported video URL scheme in {source[:32]!r} (use data: or file://)")
    if not policy.allow_paths:
        raise MediaError("video_url must be a data: or file:// URL")
    return read_local_bytes(source, policy, f"video file {source!r}", DEFAULT_MAX_VIDEO_BYTES)


def _decode(data: bytes, num_frames: int, policy: MediaPolicy) -> list:
    """Two passes over the stream: count the frames, then convert only the sampled ones (a long
    video is never held decoded in memory)."""
    try:
        import av
    except ImportError:
        raise MediaError("video input needs PyAV (pip install av)") from None

    def frames():
        with av.open(io.BytesIO(data)) as container:
            if not container.streams.video:
                raise MediaError("the video has no video stream")
            yield from container.decode(video=0)
    try:
        total = 0
        for frame in frames():
            if frame.width * frame.height > policy.max_image_pixels:
                raise MediaError(f"video frames are {frame.width}x{frame.height} pixels; the limit is "
                                 f"{policy.max_image_pixels} pixels")
            total += 1
            if total > MAX_DECODED_FRAMES:
                raise MediaError(f"the video has more than {MAX_DECODED_FRAMES} frames")
        if total == 0:
            raise MediaError("the video has no decodable frames")
        wanted = sample_indices(total, num_frames)
        keep = set(wanted)
        picked = {}
        for i, frame in enumerate(frames()):
            if i in keep:
                picked[i] = frame.to_image().convert("RGB")
    except MediaError:
        raise
    except Exception as e:  # av raises InvalidDataError, FFmpegError, ValueError, ...
        raise MediaError(f"the video could not be decoded ({type(e).__name__}: {e})") from None
    if len(picked) != len(keep):
        raise MediaError("the video's frames changed between decoding passes")
    return [picked[i] for i in wanted]


def _frames_from_arrays(source, num_frames: int) -> list:
    """Already decoded frames (offline API): [T, H, W, 3] uint8 array / tensor or a list of frames."""
    import numpy as np
    from PIL import Image
    items = list(source) if isinstance(source, (list, tuple)) else None
    if items is None:
        arr = source.numpy() if hasattr(source, "numpy") and not isinstance(source, np.ndarray) else source
        arr = np.asarray(arr)
        if arr.ndim != 4 or arr.shape[-1] != 3:
            raise MediaError(f"video frames must be a [T, H, W, 3] array, got shape {tuple(arr.shape)}")
        items = list(arr)
    if not items:
        raise MediaError("the video has no frames")
    out = []
    for f in items:
        if isinstance(f, Image.Image):
            out.append(f.convert("RGB"))
            continue
        a = np.asarray(f.numpy() if hasattr(f, "numpy") and not isinstance(f, np.ndarray) else f)
        if a.ndim != 3 or a.shape[-1] != 3:
            raise MediaError(f"a video frame must be [H, W, 3], got shape {tuple(a.shape)}")
        if a.dtype != np.uint8:
            raise MediaError(f"video frames must be uint8 RGB, got {a.dtype}")
        out.append(Image.fromarray(a, "RGB"))
    return [out[i] for i in sample_indices(len(out), num_frames)]


def load_video(source, policy: MediaPolicy, num_frames: int) -> DecodedVideo:
    if isinstance(source, VideoRef):
        source = source.source
    if num_frames < 1:
        raise MediaError(f"num_frames must be >= 1, got {num_frames}")
    is_frames = isinstance(source, (list, tuple)) or (hasattr(source, "shape") and hasattr(source, "dtype"))
    if is_frames:
        if not policy.allow_paths:
            raise MediaError("decoded video frames are accepted by the offline API only")
        frames = _frames_from_arrays(source, num_frames)
    else:
        frames = _decode(_video_bytes(source, policy), num_frames, policy)
    from splitserve.protocol.mm_inputs import image_hash
    h = hashlib.sha256(b"video:")
    for f in frames:
        h.update(image_hash(f).encode())
    return DecodedVideo(frames, h.hexdigest())
