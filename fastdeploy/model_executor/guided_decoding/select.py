"""Which backend compiles a spec: one that enforces all of it, or a 400 naming what none enforces.

`--guided-decoding-backend auto` tries xgrammar, then llguidance, and takes the first
whose grammar is never looser than the request's schema (coverage.py); a schema neither
enforces is refused, naming the keyword, unless the request opted into best effort. The
choice is made once, when the request is admitted, and travels in `GuidedSpec.backend`.
Runs in the API server and the engine without a tokenizer: parsing only, no compile.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass

import msgspec

from fastdeploy.common.errors import ParameterError
from fastdeploy.common.guided_spec import GuidedSpec, spec_param
from fastdeploy.model_executor.guided_decoding import llguidance_backend, xgrammar_backend
from fastdeploy.model_executor.guided_decoding.coverage import BACKEND_NAMES, Gap, schema_gaps

__all__ = ["BACKEND_SETTINGS", "choose_backend", "resolve_guided_spec", "validate_guided_spec"]

BACKEND_SETTINGS = ("auto", *BACKEND_NAMES, "off")

_WHAT = {"json_schema": "JSON schema", "json_object": "JSON object", "regex": "regex", "choice": "choice list",
         "grammar": "EBNF grammar", "structural_tag": "structural tag"}


@dataclass(frozen=True)
class _Verdict:
    """What one backend would make of a spec."""

    backend: str
    gaps: tuple[Gap, ...] = ()  # uses of keywords it would not enforce
    error: str = ""  # it cannot take the spec at all

    @property
    def exact(self) -> bool:
        return not self.error and not self.gaps


def _tag_schemas(node, path: str = ""):
    """(path, schema) of every JSON schema inside a structural tag."""
    if isinstance(node, dict):
        if node.get("type") == "json_schema" and "json_schema" in node:
            yield f"{path}/json_schema", node["json_schema"]
        for key, value in node.items():
            yield from _tag_schemas(value, f"{path}/{key}")
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from _tag_schemas(value, f"{path}/{i}")


def _gaps(spec: GuidedSpec, backend: str) -> tuple[Gap, ...]:
    if spec.kind == "json_schema":
        return tuple(schema_gaps(json.loads(spec.value), backend))
    if spec.kind == "structural_tag":
        return tuple(Gap(g.keyword, f"{where}{g.path}", g.why)
                     for where, schema in _tag_schemas(json.loads(spec.value)) for g in schema_gaps(schema, backend))
    return ()


def _verdict(spec: GuidedSpec, backend: str) -> _Verdict:
    try:
        gaps = _gaps(spec, backend)
    except (TypeError, AttributeError, ValueError, KeyError) as e:  # a keyword with a value of the wrong shape
        return _Verdict(backend, (), f"malformed schema ({type(e).__name__}: {e})")
    parse = xgrammar_backend.parse if backend == "xgrammar" else llguidance_backend.parse
    try:
        parse(spec)
    except ValueError as e:
        refused = llguidance_backend.refused_keyword(str(e)) if backend == "llguidance" else None
        if refused is None:
            return _Verdict(backend, gaps, str(e))
        # llguidance refuses what it cannot enforce: a gap, found by llguidance itself.
        if all(g.keyword != refused[0] for g in gaps):
            gaps += (Gap(refused[0], None, refused[1]),)
    return _Verdict(backend, gaps)


def _refusal(spec: GuidedSpec, verdicts: list[_Verdict]) -> str:
    with_gaps = [v for v in verdicts if v.gaps]
    if not with_gaps:
        return f"invalid {_WHAT.get(spec.kind, spec.kind)}: {verdicts[0].error}"
    # Name a keyword no candidate enforces when there is one (the usual case).
    common = set.intersection(*({g.keyword for g in v.gaps} for v in with_gaps))
    first = next((g for v in with_gaps for g in v.gaps if g.keyword in common), with_gaps[-1].gaps[0])
    def detail(v: _Verdict) -> str:
        if v.error:
            return f"{v.backend}: {v.error}"
        return f"{v.backend}: {next((g for g in v.gaps if g.keyword == first.keyword), v.gaps[0])}"

    details = "; ".join(detail(v) for v in verdicts)
    names = [v.backend for v in verdicts]
    who = f"{names[0]} does not enforce" if len(names) == 1 else f"neither {' nor '.join(names)} enforces"
    return (f"the {_WHAT.get(spec.kind, spec.kind)} keyword `{first.keyword}` cannot be enforced: {who} "
            f"it exactly ({details}), and a looser grammar could produce output that breaks the schema. Remove it, "
            "or set `guided_best_effort: true` to accept such output")


@functools.lru_cache(maxsize=128)  # keys hold whole schemas: keep it small
def choose_backend(spec: GuidedSpec, setting: str) -> str:
    """The backend that compiles `spec` under `--guided-decoding-backend setting`.

    The first of the candidates (under "auto": xgrammar, then llguidance for JSON schemas)
    that enforces the whole spec; with `spec.best_effort`, else the one that can take it
    with the fewest gaps.
    Raises ParameterError naming the field and, for an unenforceable schema, the keyword.
    """
    if setting not in BACKEND_NAMES and setting != "auto":
        raise ParameterError(f"structured output is disabled on this server (--guided-decoding-backend {setting})",
                             spec_param(spec))
    if setting != "auto":
        candidates: tuple[str, ...] = (setting,)
    elif spec.kind in ("json_schema", "regex"):
        # A regex xgrammar cannot read (a Unicode property class such as \p{L}) goes to
        # llguidance, whose regex syntax has it; both match a regex they read exactly.
        candidates = BACKEND_NAMES
    else:
        # EBNF and structural tags are written in xgrammar's dialects, and both backends
        # enforce the other kinds exactly: no second opinion on a spec xgrammar calls invalid.
        candidates = ("xgrammar",)
    verdicts = []
    for backend in candidates:
        verdict = _verdict(spec, backend)
        if verdict.exact:
            return backend
        verdicts.append(verdict)
    usable = [v for v in verdicts if not v.error]
    if spec.best_effort and usable:
        return min(usable, key=lambda v: len(v.gaps)).backend
    message = _refusal(spec, verdicts)
    others = [b for b in BACKEND_NAMES if b not in candidates]
    if setting != "auto" and spec.kind == "json_schema" and any(_verdict(spec, b).exact for b in others):
        message += f" ({others[0]} enforces this schema: --guided-decoding-backend auto or {others[0]})"
    raise ParameterError(message, spec_param(spec))


def resolve_guided_spec(spec: GuidedSpec, setting: str, disable_any_whitespace: bool = False) -> GuidedSpec:
    """`spec` with the server's whitespace default filled in and its backend chosen.

    A spec that already names a backend (offline callers may pin one) keeps it if `setting`
    allows it and it enforces the spec. Idempotent. Raises ParameterError (see choose_backend).
    """
    if spec.disable_any_whitespace is None:
        spec = msgspec.structs.replace(spec, disable_any_whitespace=disable_any_whitespace)
    if spec.backend and setting in BACKEND_SETTINGS[:-1]:  # not "off": choose_backend refuses that
        if spec.backend not in BACKEND_NAMES:
            raise ParameterError(f"unknown grammar backend {spec.backend!r}; one of {', '.join(BACKEND_NAMES)}",
                                 spec_param(spec))
        if setting != "auto" and spec.backend != setting:
            raise ParameterError(f"this server's structured output runs on {setting}, not {spec.backend}",
                                 spec_param(spec))
        setting = spec.backend
    base = msgspec.structs.replace(spec, backend="")
    return msgspec.structs.replace(base, backend=choose_backend(base, setting))


def validate_guided_spec(spec: GuidedSpec, setting: str = "auto") -> None:
    """Refuse, in the API server and without a tokenizer, a spec that is invalid or that no
    backend allowed by `setting` enforces. Raises ParameterError naming the field."""
    resolve_guided_spec(spec, setting)
