"""ASGI middleware that checks a request body before any route parses it.

A body over the size limit gets 413; a JSON body that is not strict JSON (RFC 8259:
valid UTF-8, no lone UTF-16 surrogates, no NaN or Infinity) or that nests objects and
arrays too deep gets 400. The route then parses the same bytes, which this layer has
already read and replays.
"""

from __future__ import annotations

from typing import Any

import orjson

from fastdeploy.entrypoints.openai.errors import APIError
from fastdeploy.entrypoints.openai.request_limits import TransportLimits

# A body a little over the limit is read to its end before the 413, so that a client still
# writing it reads the answer instead of a reset connection; a far larger one is cut short.
DRAIN_FACTOR = 4


def too_large(size: int, limit: int) -> APIError:
    return APIError(413, f"the request body is at least {size} bytes; this server takes at most {limit} bytes "
                         "(--max-request-body-bytes)", "invalid_request_error", None, "request_too_large")


def deeper_than(value: Any, limit: int) -> bool:
    """Whether objects and arrays nest more than `limit` levels in `value` (iterative: no recursion limit)."""
    stack = [(value, 1)] if isinstance(value, (dict, list)) else []
    while stack:
        node, depth = stack.pop()
        children = node.values() if isinstance(node, dict) else node
        if depth > limit:
            return True
        stack.extend((c, depth + 1) for c in children if isinstance(c, (dict, list)))
    return False


def not_json_message(body: bytes, exc: orjson.JSONDecodeError) -> str:
    """Why `body` is no JSON, in words that fit the cause. The parser reports bytes that are not
    UTF-8 (a Latin-1 or UTF-16 body) as "surrogates not allowed", which names the wrong fault."""
    try:
        body.decode("utf-8")
    except UnicodeDecodeError as bad:
        wide = body[:2] in (b"\xff\xfe", b"\xfe\xff") or b"\x00" in body[:4]
        likely = ", likely UTF-16 or UTF-32" if wide else ""
        return (f"the request body is not valid JSON: it is not UTF-8 (invalid byte at offset {bad.start}{likely}); "
                "JSON text must be UTF-8")
    if body.count(b"\x00") * 4 >= len(body) > 0:
        return "the request body is not valid JSON: it looks like UTF-16 or UTF-32; JSON text must be UTF-8"
    hint = " (a lone UTF-16 surrogate such as \\ud800 is no character)" if "surrogate" in str(exc) else ""
    return f"the request body is not valid JSON: {exc}{hint}"


def json_error(body: bytes, max_depth: int) -> APIError | None:
    """The 400 for a body that is not strict JSON or nests too deep, or None."""
    try:
        value = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        return APIError(400, not_json_message(body, exc), "invalid_request_error", None, "invalid_json")
    # Counting brackets is a bound on the depth that costs no Python per byte.
    if body.count(b"[") + body.count(b"{") > max_depth and deeper_than(value, max_depth):
        return APIError(400, f"the request body nests objects and arrays more than {max_depth} levels deep "
                             "(--max-json-depth)", "invalid_request_error", None, "json_too_deep")
    return None


def is_json(content_type: bytes | None) -> bool:
    """FastAPI parses a body as JSON when it has no content type or a `json` / `+json` one."""
    if not content_type:
        return True
    media = content_type.split(b";", 1)[0].strip().lower()
    return media.endswith(b"/json") or media.endswith(b"+json")


class BodyGuard:
    def __init__(self, app, limits: TransportLimits) -> None:
        self.app = app
        self.limits = limits

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT", "PATCH"):
            await self.app(scope, receive, send)
            return
        limit = self.limits.max_body_bytes
        headers = dict(scope["headers"])
        declared = headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit * DRAIN_FACTOR:
            await too_large(int(declared), limit).response()(scope, receive, send)
            return
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # nobody to answer
            chunk = message.get("body", b"")
            size += len(chunk)
            if size <= limit:
                chunks.append(chunk)
            elif size > limit * DRAIN_FACTOR:
                break
            if not message.get("more_body", False):
                break
        if size > limit:
            await too_large(size, limit).response()(scope, receive, send)
            return
        body = b"".join(chunks)
        error = json_error(body, self.limits.max_json_depth) if body and is_json(headers.get(b"content-type")) \
            else None
        if error is not None:
            await error.response()(scope, receive, send)
            return

        replayed = False

        async def replay() -> dict:
            nonlocal replayed
            if replayed:
                return await receive()  # after the body: waits for the client's disconnect
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)
