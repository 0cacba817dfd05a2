"""Errors in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

from __future__ import annotations

from collections.abc import Sequence

from fastapi.responses import JSONResponse


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.param = param
        self.code = code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param, "invalid_value" if param else None)


def engine_unavailable(message: str) -> APIError:
    return APIError(503, message, "service_unavailable", None, "engine_unavailable")


# Pydantic error types that only say "this union member's type did not match": when a field
# accepts several shapes, another error of the same field says more.
_TYPE_MISMATCHES = {"string_type", "list_type", "int_type", "int_from_float", "int_parsing", "float_type",
                    "float_parsing", "dict_type", "bool_type", "bool_parsing", "model_type", "model_attributes_type",
                    "none_required", "is_instance_of", "literal_error"}
_MEMBER_TAGS = {"str", "int", "float", "bool", "constrained-str", "constrained-int", "constrained-float"}


def validation_message(errors: Sequence[dict]) -> tuple[str, str | None]:
    """(message, param) for a request pydantic rejected: the most telling error, with union
    member tags ("list[str]", "[key]") left out of the field path."""
    if not errors:
        return "invalid request", None
    first = next((e for e in errors if e.get("type") not in _TYPE_MISMATCHES), errors[0])
    if first.get("type") == "json_invalid":
        return f"the request body is not valid JSON: {first.get('ctx', {}).get('error', '')}".rstrip(": "), None
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    if not loc and first.get("type") in ("model_type", "model_attributes_type", "dict_type"):
        # A JSON array or scalar, or a body sent as another content type (read as raw bytes).
        return "the request body must be a JSON object, sent as Content-Type: application/json", None
    loc = loc[:1] + [p for p in loc[1:] if "[" not in p and p not in _MEMBER_TAGS]
    if first.get("type") == "string_pattern_mismatch" and loc[:1] == ["logit_bias"]:
        return (f"logit_bias key {first.get('input')!r} is not a token id (a decimal number without leading zeros)",
                "logit_bias")
    if first.get("type") == "extra_forbidden" and loc:
        # At any depth (`messages.0.tool_calls`, `stream_options.foo`): named, as a top-level one is.
        return f"request argument `{'.'.join(loc)}` is not supported by this server", loc[0]
    return f"{'.'.join(loc) or 'body'}: {first.get('msg', 'invalid value')}", (loc[0] if loc else None)
