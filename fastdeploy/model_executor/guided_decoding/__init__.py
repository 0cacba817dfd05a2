"""Guided (structured) decoding with xgrammar: request parsing, async compilation,
per-request matchers and the token bitmask. See DESIGN.md, "Guided decoding"."""

from fastdeploy.model_executor.guided_decoding.bitmask import apply_token_bitmask_inplace
from fastdeploy.model_executor.guided_decoding.compiler import (
    GrammarCompileService,
    compile_spec,
    tokenizer_info_from_hf,
)
from fastdeploy.model_executor.guided_decoding.matcher import GuidedState, fill_bitmasks
from fastdeploy.model_executor.guided_decoding.spec import (
    GUIDED_KINDS,
    GuidedSpec,
    guided_spec_from_request,
    validate_guided_spec,
)

__all__ = [
    "GUIDED_KINDS",
    "GrammarCompileService",
    "GuidedSpec",
    "GuidedState",
    "apply_token_bitmask_inplace",
    "compile_spec",
    "fill_bitmasks",
    "guided_spec_from_request",
    "tokenizer_info_from_hf",
    "validate_guided_spec",
]
