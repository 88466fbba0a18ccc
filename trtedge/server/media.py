"""Local media files (``file://`` URLs in requests) confined to ``--allowed-local-media-path``.

``resolve_local_media`` is the one gate: it resolves ``..`` and symlinks first, then refuses (403)
anything that does not end up inside the allowed directory, so neither a crafted path nor a symlink
planted inside the directory can reach other files.
"""

from __future__ import annotations

import os
from pathlib import Path
from urllib.parse import unquote, urlsplit

from trtedge.server.errors import APIError


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
