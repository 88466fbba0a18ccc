"""The bytes behind a media URL in a request: ``data:`` URLs, local files and remote http(s) URLs.

Local files are confined to ``--allowed-local-media-path``: ``resolve_local_media`` is the one gate; it
resolves ``..`` and symlinks first, then refuses (403) anything that does not end up inside the allowed
directory, so neither a crafted path nor a symlink planted inside the directory can reach other files.
Remote URLs are refused (403) unless ``--allow-remote-media``; then they are fetched with httpx, streamed
so that a body over ``--max-media-bytes`` is dropped at the cap (413), within ``--media-fetch-timeout``.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import os
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, unquote_to_bytes, urlsplit

import httpx

from trtedge.server.config import ServeConfig
from trtedge.server.errors import APIError

MAX_REDIRECTS = 5


async def fetch_media(url: str, config: ServeConfig, param: str, audio: bool = False) -> bytes:
    """The bytes ``url`` names: a ``data:`` URL, an http(s) URL, or a local file (``file://`` or a path),
    as ``config``'s media flags allow. Raises ``APIError``: 403 for a source the server does not allow,
    404 for a missing local file, 413 past ``max_media_bytes`` (``max_audio_bytes`` for ``audio``), 400
    for a malformed URL or a remote fetch that failed or timed out."""
    limit = Limit(config.max_audio_bytes, "--max-audio-bytes") if audio else Limit(config.max_media_bytes)
    scheme = urlsplit(url).scheme.lower()
    if scheme == "data":
        return _data_url(url, limit, param)
    if scheme in ("http", "https"):
        return await _remote(url, config, param, limit)
    if scheme in ("", "file"):
        path = resolve_local_media(url, config.allowed_local_media_path, param)
        size = path.stat().st_size
        if size > limit.bytes:
            raise too_large(f"the media file is {size} bytes", limit, param)
        return await asyncio.to_thread(path.read_bytes)
    raise APIError(
        400,
        f"unsupported media URL scheme {scheme!r}: send a data: URL, an http(s) URL or a file:// path",
        param=param,
        code="invalid_media_url",
    )


@dataclass(frozen=True)
class Limit:
    bytes: int
    flag: str = "--max-media-bytes"


def too_large(what: str, limit: Limit, param: str) -> APIError:
    return APIError(
        413, f"{what}; the limit is {limit.flag} {limit.bytes}", param=param, code="media_too_large"
    )


def _data_url(url: str, limit: Limit, param: str) -> bytes:
    head, comma, payload = url[5:].partition(",")
    if not comma:
        raise APIError(
            400, "a data: URL needs a comma before its data", param=param, code="invalid_media_url"
        )
    if head.lower().endswith(";base64"):
        if len(payload) // 4 * 3 > limit.bytes + 3:
            raise too_large(f"the data: URL holds about {len(payload) // 4 * 3} bytes", limit, param)
        try:
            data = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise APIError(
                400, "the data: URL is not valid base64", param=param, code="invalid_media_url"
            ) from None
    else:
        data = unquote_to_bytes(payload)
    if len(data) > limit.bytes:
        raise too_large(f"the data: URL holds {len(data)} bytes", limit, param)
    if not data:
        raise APIError(400, "the data: URL is empty", param=param, code="invalid_media_url")
    return data


async def _remote(url: str, config: ServeConfig, param: str, limit: Limit) -> bytes:
    if not config.allow_remote_media:
        raise APIError(
            403,
            "remote media URLs are not allowed: start the server with --allow-remote-media, or send the "
            "media inline as a data: URL",
            param=param,
            code="remote_media_forbidden",
        )
    timeout = config.media_fetch_timeout
    try:
        return await asyncio.wait_for(_download(url, limit, timeout, param), timeout)
    except (asyncio.TimeoutError, httpx.TimeoutException):
        raise APIError(
            400,
            f"fetching the media URL took over {timeout:g}s (--media-fetch-timeout)",
            param=param,
            code="media_fetch_timeout",
        ) from None
    except httpx.HTTPError as e:
        raise APIError(
            400, f"cannot fetch the media URL: {type(e).__name__}", param=param, code="media_fetch_failed"
        ) from None


async def _download(url: str, limit: Limit, timeout: float, param: str) -> bytes:
    async with httpx.AsyncClient(
        timeout=timeout, follow_redirects=True, max_redirects=MAX_REDIRECTS
    ) as client:
        async with client.stream("GET", url) as response:
            if response.status_code != 200:
                raise APIError(
                    400,
                    f"fetching the media URL answered HTTP {response.status_code}",
                    param=param,
                    code="media_fetch_failed",
                )
            length = response.headers.get("content-length", "")
            if length.isdigit() and int(length) > limit.bytes:
                raise too_large(f"the media URL announces {length} bytes", limit, param)
            body = bytearray()
            async for chunk in response.aiter_bytes():
                body += chunk
                if len(body) > limit.bytes:
                    raise too_large(f"the media URL sent more than {limit.bytes} bytes", limit, param)
            return bytes(body)


def resolve_local_media(url: str, allowed_dir: str | None, param: str | None = None) -> Path:
    """The real path of the file that ``url`` (``file:///abs/path`` or a path) names.

    Raises ``APIError`` 403 when local media is not enabled (``allowed_dir`` is None) or the file lies
    outside ``allowed_dir`` after resolving ``..`` and symlinks; 404 when it is inside but missing; 400
    for a malformed URL. A relative path is taken relative to ``allowed_dir``. Open the returned path.
    """
    if not allowed_dir:
        raise APIError(
            403,
            "local media files are not allowed: start the server with --allowed-local-media-path DIR",
            param=param,
            code="local_media_forbidden",
        )
    path = _path_of(url, param)
    root = Path(os.path.realpath(allowed_dir))
    candidate = Path(path) if os.path.isabs(path) else root / path
    real = Path(os.path.realpath(candidate))
    if not real.is_relative_to(root):
        raise APIError(
            403,
            "the media file is outside --allowed-local-media-path",
            param=param,
            code="local_media_forbidden",
        )
    if not real.is_file():
        raise APIError(
            404, "no such media file under --allowed-local-media-path", param=param, code="not_found"
        )
    return real


def _path_of(url: str, param: str | None) -> str:
    if url.startswith("file:"):
        parts = urlsplit(url)
        if parts.netloc not in ("", "localhost"):
            raise APIError(
                400, "a file:// URL must name a local file (no host)", param=param, code="invalid_value"
            )
        path = unquote(parts.path)
    else:
        path = url
    if not path or "\0" in path:
        raise APIError(400, "the media path is empty or malformed", param=param, code="invalid_value")
    return path
