"""Admission of a request: the engine's limits, then the grammar backend that will enforce it."""

from __future__ import annotations

from fastdeploy.common.limits import EngineLimits
from fastdeploy.common.request import EngineRequest
from fastdeploy.model_executor.guided_decoding.select import resolve_guided_spec


def admit_request(limits: EngineLimits, request: EngineRequest, prompt_param: str = "prompt") -> None:
    """Raise ParameterError naming the parameter that makes `request` impossible.

    A structured-output request also gets its grammar backend chosen and the server's
    whitespace default filled in (request.params.guided is replaced; idempotent).
    """
    limits.validate(request.prompt_token_ids, request.params, prompt_param)
    if request.params.guided is not None:
        request.params.guided = resolve_guided_spec(request.params.guided, limits.guided_backend,
                                                    limits.disable_any_whitespace)
