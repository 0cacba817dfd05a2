"""The offline engine on the embedded model: batching invariance, preemption, seeds, n, errors."""

from __future__ import annotations

import pytest

from fastdeploy import LLM, SamplingParams
from fastdeploy.common.sampling_params import ParameterError

TOPICS = ["rivers", "the moon", "bread", "chess", "volcanoes", "music", "bees", "glass", "trains", "rain",
          "salt", "maps", "owls", "clocks", "paper", "wind"]


def prompts_of_varied_length() -> list[str]:
    # Lengths from about 10 to about 250 tokens, so long prompts need several prefill chunks.
    return [("Context: " + "the quick brown fox jumps over the lazy dog. " * (i * i // 10)) +
            f"Write a short note about {topic}." for i, topic in enumerate(TOPICS)]


def test_batched_chunked_and_preempted_runs_equal_each_run_alone(llm):
    prompts = prompts_of_varied_length()
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    alone = [llm.generate(p, params)[0].outputs[0].token_ids for p in prompts]
    # A pool of 24 blocks x 16 tokens cannot hold all 16 sequences at once, and a step
    # budget of 64 tokens splits every longer prompt into chunks.
    tight = LLM(max_num_seqs=16, num_kv_blocks=24, max_num_batched_tokens=64)
    together = [r.outputs[0].token_ids for r in tight.generate(prompts, params)]
    assert tight.engine.scheduler.num_preemptions > 0
    assert together == alone
    assert tight.engine.block_manager.num_free_blocks == 24


def test_seed_reproduces_output_whatever_the_batch(llm):
    params = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, max_tokens=16, seed=7)
    alone = llm.generate("Once upon a time", params)[0].outputs[0].text
    batch = llm.generate(["Hello there", "Once upon a time", "A recipe for soup"],
                         [SamplingParams(temperature=1.0, max_tokens=16), params,
                          SamplingParams(temperature=0.5, max_tokens=16)])
    assert batch[1].outputs[0].text == alone


def test_n_samples_and_finish_reasons(llm):
    out = llm.chat([{"role": "user", "content": "Say something."}],
                   SamplingParams(n=3, temperature=1.0, max_tokens=8, seed=3))[0]
    assert len(out.outputs) == 3 and len({o.text for o in out.outputs}) > 1
    assert all(o.finish_reason in ("stop", "length") and len(o.token_ids) <= 8 for o in out.outputs)
    greedy = llm.chat([{"role": "user", "content": "What is 2+2?"}], SamplingParams(temperature=0, max_tokens=64))
    first = greedy[0].outputs[0]
    assert first.finish_reason == "stop" and first.token_ids[-1] == 2  # <|im_end|>
    stop_id = first.token_ids[1]
    stopped = llm.chat([{"role": "user", "content": "What is 2+2?"}],
                       SamplingParams(temperature=0, max_tokens=64, stop_token_ids=[stop_id]))[0].outputs[0]
    assert stopped.token_ids == first.token_ids[:2] and stopped.stop_reason == stop_id


def test_logprobs_raw_are_log_softmax_and_ranked(llm):
    out = llm.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=6, logprobs=5))[0]
    for entry in out.outputs[0].logprobs:
        assert len(entry.top_logprobs) == 5
        assert entry.token_id == entry.top_logprobs[0].token_id  # greedy picks the top token
        assert entry.logprob <= 0


@pytest.mark.parametrize(
    "params, param",
    [
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.01), "top_p"),
        (dict(temperature=-0.5), "temperature"),
        (dict(logprobs=21), "top_logprobs"),
        (dict(min_p=2.0), "min_p"),
        (dict(max_tokens=0), "max_tokens"),
    ],
)
def test_bad_parameters_name_the_parameter(llm, params, param):
    with pytest.raises(ParameterError) as info:
        llm.generate("hi", SamplingParams(**params))
    assert info.value.param == param


def test_prompt_longer_than_the_context_is_refused():
    small = LLM(max_model_len=32)
    with pytest.raises(ParameterError) as info:
        small.generate("word " * 40, SamplingParams(max_tokens=4))
    assert info.value.param == "prompt" and "context" in str(info.value)
    assert not small.engine.has_work()


def test_prompts_as_text_token_ids_and_vllm_dicts_give_the_same_answer(llm):
    params = SamplingParams(temperature=0.0, max_tokens=6)
    text = "Write a short note about owls."
    ids = llm.tokenizer.encode(text, add_special_tokens=False)
    outs = llm.generate([text, ids, {"prompt": text}, {"prompt_token_ids": ids}], params)
    assert len({tuple(o.outputs[0].token_ids) for o in outs}) == 1
    assert [o.prompt for o in outs] == [text, None, text, None]
    assert llm.generate({"prompt_token_ids": ids}, params)[0].outputs[0].token_ids == outs[0].outputs[0].token_ids


@pytest.mark.parametrize("prompt", [{"prompt_ids": [1, 2]}, {"prompt": "a", "prompt_token_ids": [1]}, {"prompt": 5},
                                    [1, "2"], [True, 2], 3.5])
def test_malformed_prompts_are_refused_with_what_is_taken(llm, prompt):
    with pytest.raises(TypeError, match="prompt 0"):
        llm.generate([prompt], SamplingParams(max_tokens=2))
    assert not llm.engine.has_work()
