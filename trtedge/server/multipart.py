"""multipart/form-data bodies (file uploads) parsed with the standard library's ``email`` parser
(starlette's form parser needs python-multipart, which trtedge does not depend on).

``parse_form`` returns the fields in order: text fields as ``str``, file fields as ``Upload``. A body
that is not multipart/form-data, has no boundary, or has a part without a name is a 400; the body's
size is bounded by the caller before parsing (``read_body``).
"""

from __future__ import annotations

import email.parser
import email.policy
from dataclasses import dataclass

from trtedge.server.errors import APIError


@dataclass(frozen=True)
class Upload:
    filename: str
    content_type: str
    data: bytes


def parse_form(content_type: str | None, body: bytes) -> list[tuple[str, str | Upload]]:
    """(name, value) of each part of a multipart/form-data body."""
    if not content_type or content_type.split(";", 1)[0].strip().lower() != "multipart/form-data":
        raise APIError(
            400,
            "this endpoint takes multipart/form-data (a file upload); got "
            f"{(content_type or 'no content type').split(';', 1)[0]!r}",
            code="invalid_content_type",
        )
    if "boundary=" not in content_type:
        raise APIError(400, "the multipart/form-data content type has no boundary", code="invalid_body")
    head = f"Content-Type: {content_type}\r\nMIME-Version: 1.0\r\n\r\n".encode("latin-1", "replace")
    message = email.parser.BytesParser(policy=email.policy.HTTP).parsebytes(head + body)
    if not message.is_multipart() or message.defects:
        raise APIError(400, "the multipart/form-data body is malformed", code="invalid_body")
    fields: list[tuple[str, str | Upload]] = []
    for part in message.iter_parts():
        if part.get_content_disposition() != "form-data":
            raise APIError(400, "a multipart part is not form-data", code="invalid_body")
        name = part.get_param("name", header="content-disposition")
        if not name:
            raise APIError(400, "a multipart part has no name", code="invalid_body")
        data = part.get_payload(decode=True) or b""
        filename = part.get_filename()
        if filename is not None:
            fields.append((name, Upload(filename, part.get_content_type(), data)))
            continue
        try:
            fields.append((name, data.decode(part.get_content_charset() or "utf-8")))
        except (UnicodeDecodeError, LookupError):
            raise APIError(
                400, f"field {name!r} is not valid UTF-8 text", param=name, code="invalid_value"
            ) from None
    return fields
