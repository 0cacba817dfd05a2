"""Driving GuidedState token by token with the real tokenizer, the batch bitmask, and its
application to logits; the grammar tests run once per backend (the `compile_service` fixture)."""

from __future__ import annotations

import json

import pytest
import torch

from fastdeploy.entrypoints.openai.guided_request import guided_spec_from_request
from fastdeploy.model_executor.guided_decoding import (
    GuidedSpec,
    GuidedState,
    apply_token_bitmask_inplace,
    fill_bitmasks,
)
from fastdeploy.spec_decode.guided_drafts import fill_draft_bitmasks

EOS = 2
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1},
        "age": {"type": "integer", "minimum": 0},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
        "kind": {"enum": ["cat", "dog"]},
    },
    "required": ["name", "age", "kind"],
}


def allowed(bitmask: torch.Tensor, row: int, token: int) -> bool:
    return bool((int(bitmask[row, token // 32]) >> (token % 32)) & 1)


def drive(state: GuidedState, token_ids: list[int], vocab_size: int) -> bool:
    """Feed tokens then eos; at every step the bitmask must agree with accept().

    llguidance's mask may be narrower than what it accepts: where the grammar forces several
    bytes (`{"name":"` in compact JSON) it allows only the longest token, while accept() takes
    any tokenization of them. Never the other way round: a masked-in token is always accepted.
    """
    bitmask = torch.zeros(1, (vocab_size + 31) // 32, dtype=torch.int32)
    for t in [*token_ids, EOS]:
        state.fill_bitmask(bitmask, 0)
        ok = state.accept(t)
        if state.backend == "xgrammar" or allowed(bitmask, 0, t):
            assert ok == allowed(bitmask, 0, t), "bitmask and matcher disagree"
        if not ok:
            return False
    return state.is_terminated


def state_for(compile_service, body: dict) -> GuidedState:
    return GuidedState(compile_service.compile(guided_spec_from_request(body)))


@pytest.mark.parametrize(
    "body, good, bad",
    [
        (
            {"guided_json": SCHEMA},
            [{"name": "Tom", "age": 3, "kind": "cat"}, {"name": "Ada", "age": 36, "tags": ["x", "y"], "kind": "dog"}],
            [{"name": "Tom", "age": -3, "kind": "cat"}, {"name": "Tom", "kind": "cat"},
             {"name": "", "age": 1, "kind": "cat"}, {"name": "Tom", "age": 1, "kind": "cow"},
             {"name": "T", "age": 1, "kind": "cat", "tags": ["a", "b", "c", "d"]}],
        ),
        ({"response_format": {"type": "json_object"}}, [{"a": [1, 2.5, None, True]}, {}],
         ["{'a': 1}", '{"a": 1'.strip()]),
        ({"guided_regex": r"\d{3}-[a-z]+"}, ["123-abc", "000-z"], ["12-abc", "123-", "123-ABC", "1234-a"]),
        ({"guided_choice": ["yes", "no", "new\nline", 'q"uote']}, ["yes", "new\nline", 'q"uote'],
         ["maybe", "ye", "yesno"]),
        ({"guided_grammar": 'root ::= "(" num ("+" num)* ")"\nnum ::= [0-9]+'}, ["(1+22+333)", "(7)"],
         ["(1+)", "1+2", "()"]),
    ],
)
def test_valid_instances_accepted_invalid_rejected(compile_service, tokenizer, body, good, bad):
    vocab = compile_service.vocab_size

    def text(x):
        return x if isinstance(x, str) else json.dumps(x)

    for x in good:
        ids = tokenizer.encode(text(x), add_special_tokens=False)
        assert drive(state_for(compile_service, body), ids, vocab), f"valid {text(x)!r} rejected"
    for x in bad:
        ids = tokenizer.encode(text(x), add_special_tokens=False)
        assert not drive(state_for(compile_service, body), ids, vocab), f"invalid {text(x)!r} accepted"


def test_structural_tag_constrains_inside_tags_only(compile_service, tokenizer):
    if compile_service.default_backend == "llguidance":
        pytest.skip("structural tags compile on xgrammar only")
    tag = {
        "type": "structural_tag",
        "format": {
            "type": "triggered_tags",
            "triggers": ["<f>"],
            "tags": [{"begin": "<f>", "content": {"type": "json_schema", "json_schema": SCHEMA}, "end": "</f>"}],
        },
    }
    body = {"structural_tag": tag}
    ok = 'Sure. <f>{"name": "Tom", "age": 3, "kind": "cat"}</f> done'
    bad = 'Sure. <f>{"name": "Tom", "age": "three", "kind": "cat"}</f>'
    vocab = compile_service.vocab_size
    assert drive(state_for(compile_service, body), tokenizer.encode(ok), vocab)
    assert not drive(state_for(compile_service, body), tokenizer.encode(bad), vocab)


@pytest.mark.parametrize("kind", ["json_schema", "json_object"])
def test_disable_any_whitespace(compile_service, tokenizer, kind):
    """Compact JSON: no whitespace outside strings (inside them it stays); the default admits it."""
    body = {"guided_json": SCHEMA} if kind == "json_schema" else {"response_format": {"type": "json_object"}}
    compact = {"name": "A b", "age": 3, "tags": ["x y"], "kind": "cat"}
    vocab = compile_service.vocab_size
    texts = {
        "compact": json.dumps(compact, separators=(",", ":")),
        "spaced": json.dumps(compact),
        "newlines": json.dumps(compact, indent=2),
    }
    for disable, admitted in ((True, {"compact"}), (False, {"compact", "spaced", "newlines"})):
        spec = guided_spec_from_request(body, disable_any_whitespace=disable)
        for name, text in texts.items():
            ids = tokenizer.encode(text, add_special_tokens=False)
            assert drive(GuidedState(compile_service.compile(spec)), ids, vocab) == (name in admitted), (disable, name)


def test_rollback_and_draft_prefix(compile_service, tokenizer):
    state = state_for(compile_service, {"guided_regex": r"\d{3}-[a-z]+"})
    ids = tokenizer.encode("123-abc")
    assert state.accept_tokens(ids) == len(ids)
    state.rollback(len(ids) - 1)
    assert state.num_accepted == 1
    # Re-accepting after rollback works; a draft stops at its first invalid token.
    draft = [*ids[1:], tokenizer.encode("X")[0], ids[-1]]
    assert state.accept_tokens(draft) == len(ids) - 1
    assert state.accept(EOS) and state.is_terminated
    with pytest.raises(ValueError):
        state.rollback(100)


def test_fill_bitmasks_batch(compile_service):
    vocab = compile_service.vocab_size
    assert fill_bitmasks([None, None], vocab) is None
    s = GuidedState(compile_service.compile(GuidedSpec("regex", "[0-9]+")))
    bm = fill_bitmasks([None, s, None], vocab)
    assert bm.dtype == torch.int32 and bm.shape == (3, (vocab + 31) // 32)
    assert (bm[0] == -1).all() and (bm[2] == -1).all()
    ref = torch.zeros(1, bm.shape[1], dtype=torch.int32)
    s.fill_bitmask(ref, 0)
    assert torch.equal(bm[1], ref[0]) and 0 < int((bm[1] != 0).sum()) < bm.shape[1]
    # Into a preallocated (reused, dirty) buffer.
    out = torch.randint(-(2**31), 2**31 - 1, (8, bm.shape[1]), dtype=torch.int32,
                        generator=torch.Generator().manual_seed(0))
    assert torch.equal(fill_bitmasks([None, s, None], vocab, out=out), bm)
    assert torch.equal(fill_bitmasks([s, None, None], vocab, out=out), bm[[1, 0, 2]])
    # A terminated state allows exactly its stop token instead of raising.
    s3 = GuidedState(compile_service.compile(GuidedSpec("choice", '["0"]')))
    zero = [t for t in range(vocab) if allowed(fill_bitmasks([s3], vocab), 0, t)]
    assert len(zero) >= 1
    assert s3.accept(zero[0]) and s3.accept(EOS) and s3.is_terminated
    term = fill_bitmasks([s3], vocab)
    assert [t for t in range(vocab) if allowed(term, 0, t)] == [EOS]
    # One batch (filled by the backend in one call): a terminated row, matchers at different
    # positions, unconstrained rows; each row as that state fills it alone.
    s4 = GuidedState(compile_service.compile(GuidedSpec("regex", "[0-9]+")))
    assert s4.accept([t for t in range(vocab) if allowed(bm, 1, t)][0])
    states = [s, None, s3, s4, None]
    mixed = fill_bitmasks(states, vocab, out=out)
    for row, state in enumerate(states):
        alone = fill_bitmasks([state], vocab) if state is not None else torch.full_like(mixed[:1], -1)
        assert torch.equal(mixed[row], alone[0]), row


def reference_apply(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    out = logits.clone()
    for b in range(logits.shape[0]):
        for v in range(logits.shape[1]):
            if not allowed(bitmask, b, v):
                out[b, v] = float("-inf")
    return out


@pytest.mark.parametrize("vocab", [32, 70, 97])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_apply_bitmask_matches_loop_reference(vocab, dtype):
    g = torch.Generator().manual_seed(vocab)
    logits = torch.randn(4, vocab, generator=g).to(dtype)
    words = (vocab + 31) // 32
    bitmask = torch.randint(-(2**31), 2**31 - 1, (4, words), generator=g, dtype=torch.int64).to(torch.int32)
    bitmask[1] = -1  # all allowed
    bitmask[2] = 0  # none allowed
    bitmask[3, 0] = -(2**31)  # only bit 31: the sign bit of the int32 word
    expected = reference_apply(logits, bitmask)
    out = apply_token_bitmask_inplace(logits, bitmask)
    assert out is logits
    assert torch.equal(logits, expected)
    allowed_rows = [[allowed(bitmask, b, v) for v in range(vocab)] for b in range(4)]
    assert torch.equal(torch.isinf(logits), ~torch.tensor(allowed_rows))


def test_apply_bitmask_on_a_non_contiguous_view_and_narrow_mask_error():
    base = torch.zeros(3, 64)
    view = base[:, :40]  # row stride 64
    bitmask = torch.full((3, 2), -1, dtype=torch.int32)
    bitmask[0, 1] = 0  # tokens 32..63 banned in row 0
    apply_token_bitmask_inplace(view, bitmask)
    assert torch.isinf(base[0, 32:40]).all() and not torch.isinf(base[0, 40:]).any()
    assert not torch.isinf(base[1:]).any()
    with pytest.raises(ValueError):
        apply_token_bitmask_inplace(torch.zeros(1, 70), torch.full((1, 2), -1, dtype=torch.int32))


def test_apply_bitmask_paddle_zero_copy():
    paddle = pytest.importorskip("paddle")
    logits = paddle.zeros([2, 70], dtype="float32")
    ptr = logits.data_ptr()
    bitmask = torch.full((2, 3), -1, dtype=torch.int32)
    bitmask[0, 0] = 0b101  # row 0: tokens 0 and 2 allowed among 0..31
    out = apply_token_bitmask_inplace(logits, paddle.to_tensor(bitmask.numpy()))
    assert out is logits and logits.data_ptr() == ptr
    row0 = logits.numpy()[0]
    assert row0[0] == 0 and row0[2] == 0 and row0[1] == float("-inf") and (row0[3:32] == float("-inf")).all()
    assert (row0[32:] == 0).all() and (logits.numpy()[1] == 0).all()
    # A torch bitmask with Paddle logits works too.
    logits2 = paddle.zeros([2, 70], dtype="float32")
    apply_token_bitmask_inplace(logits2, bitmask)
    assert (logits2.numpy() == logits.numpy()).all()


def test_draft_bitmasks_into_a_dirty_buffer(compile_service):
    """A verify step's rows (1 + drafts per sequence) filled into a reused buffer of any contents
    equal a fresh fill: unconstrained rows all ones, the matcher back where it started."""
    vocab = compile_service.vocab_size
    s = GuidedState(compile_service.compile(GuidedSpec("regex", "[0-9]+")))
    digits = [t for t in range(vocab) if allowed(fill_bitmasks([s], vocab), 0, t)][:2]
    drafts = [[5, 7], digits, []]
    fresh = fill_draft_bitmasks([None, s, None], drafts, vocab)
    assert fresh is not None and fresh.shape[0] == 3 + 3 + 1
    out = torch.randint(-(2**31), 2**31 - 1, (9, fresh.shape[1]), dtype=torch.int32,
                        generator=torch.Generator().manual_seed(1))
    assert torch.equal(fill_draft_bitmasks([None, s, None], drafts, vocab, out=out), fresh)
    assert (fresh[:3] == -1).all() and (fresh[6] == -1).all() and s.num_accepted == 0
