"""Guided (structured) decoding with xgrammar or llguidance: backend choice, async
compilation, per-request matchers and the token bitmask. See docs/structured_output.md."""

from fastdeploy.common.guided_spec import GUIDED_KINDS, GuidedSpec
from fastdeploy.model_executor.guided_decoding.backend import CompiledGrammar, GrammarBackend, TokenMatcher
from fastdeploy.model_executor.guided_decoding.bitmask import apply_token_bitmask_inplace
from fastdeploy.model_executor.guided_decoding.compiler import GrammarCompileService, build_backend
from fastdeploy.model_executor.guided_decoding.coverage import BACKEND_NAMES, Gap, schema_gaps
from fastdeploy.model_executor.guided_decoding.matcher import GuidedState, allocate_bitmask, fill_bitmasks
from fastdeploy.model_executor.guided_decoding.select import (
    BACKEND_SETTINGS,
    choose_backend,
    resolve_guided_spec,
    validate_guided_spec,
)

__all__ = [
    "BACKEND_NAMES",
    "BACKEND_SETTINGS",
    "GUIDED_KINDS",
    "CompiledGrammar",
    "Gap",
    "GrammarBackend",
    "GrammarCompileService",
    "GuidedSpec",
    "GuidedState",
    "TokenMatcher",
    "allocate_bitmask",
    "apply_token_bitmask_inplace",
    "build_backend",
    "choose_backend",
    "fill_bitmasks",
    "resolve_guided_spec",
    "schema_gaps",
    "validate_guided_spec",
]
