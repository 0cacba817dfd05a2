"""A runner step in two halves: `launch` returns an `InFlightStep`, `finish` its output.

On the CPU: launching then finishing gives the frame `execute` gives for the same steps
(seeded, masks and logprobs on), a step with nothing to sample is finished at launch, and the
runner packs with the C++ op where it is built.
"""

from __future__ import annotations

import pytest

from fastdeploy import LLM
from fastdeploy.common.config import CacheConfig, EngineConfig, SchedulerConfig
from fastdeploy.common.sampling_params import SamplingParams
from fastdeploy.common.step_frame import split_by_sequence, unpack_step_frame
from fastdeploy.common.step_input import IN_FLIGHT_TOKEN, ChunkInput, NewSequence, StepInput
from fastdeploy.ops.step_packer import CpuOpPacker
from fastdeploy.worker.in_flight_step import InFlightStep
from fastdeploy.worker.model_runner import ModelRunner
from tests.random_qwen2 import save_random_qwen2

PROMPT = [5, 17, 42, 9, 3]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return save_random_qwen2(tmp_path_factory.mktemp("qwen2_in_flight"), vocab_size=2_000)


def _runner(model_dir: str) -> ModelRunner:
    return ModelRunner(EngineConfig(
        model=model_dir, device="cpu", dtype="float32", guided_decoding_backend="off", enable_keep_sampling_mask=True,
        cache=CacheConfig(block_size=4, num_blocks=32),
        scheduler=SchedulerConfig(max_num_seqs=2, max_model_len=32, max_num_batched_tokens=32)))


BLOCKS = [[1, 2, 3], [4, 5, 6]]


def _step(n: int, last: list[int]) -> StepInput:
    """Step 0: two sequences' prefill; step n > 0: their decode of `last`, each's newest token."""
    if n == 0:
        params = [SamplingParams(top_p=0.9, seed=3, logprobs=2), SamplingParams(temperature=0.0)]
        news = [NewSequence(i, PROMPT[: 4 + i], p, return_sampling_mask=True) for i, p in enumerate(params)]
        return StepInput(0, news, [ChunkInput(i, PROMPT[: 4 + i], 0, BLOCKS[i], True) for i in range(2)], [])
    return StepInput(n, [], [ChunkInput(i, [last[i]], 4 + i + n - 1, BLOCKS[i], True) for i in range(2)], [])


def _run(runner: ModelRunner, halves: bool, num_steps: int) -> list[bytes]:
    frames: list[bytes] = []
    last: list[int] = []
    for n in range(num_steps):
        step = _step(n, last)
        if halves:
            launched = runner.launch(step)
            assert isinstance(launched, InFlightStep) and launched.finished is None
            output = runner.finish(launched)
        else:
            output = runner.execute(step)
        output.wait_mask_ids()
        frames.append(bytes(output.frame))
        last = [r.token_ids[-1] for r in split_by_sequence(unpack_step_frame(output.frame))]
    return frames


def test_launch_then_finish_equals_execute(model_dir) -> None:
    halves = _run(_runner(model_dir), halves=True, num_steps=4)
    whole = _run(_runner(model_dir), halves=False, num_steps=4)
    assert halves == whole
    frame = unpack_step_frame(halves[-1])
    assert frame.mask_offsets is not None and frame.lp_ids is not None and len(frame.token_ids) == 2


def test_step_without_chunks_is_finished_at_launch(model_dir) -> None:
    runner = _runner(model_dir)
    launched = runner.launch(StepInput(7, [], [], []))
    assert launched.finished is not None and launched.sampling is None
    output = runner.finish(launched)
    frame = unpack_step_frame(output.frame)
    assert frame.message_id == 7 and len(frame.seq_ids) == 0


def test_host_runner_packs_with_the_built_op(model_dir) -> None:
    assert isinstance(_runner(model_dir).packer, CpuOpPacker)


def test_the_runner_switches_samplers_between_steps_once_the_compile_is_done(model_dir, monkeypatch) -> None:
    """The runner's own wiring of `PendingSampler`: started while the (stand-in) compile runs, it
    serves on the torch path, switches in the first launch after the compile is done, and its
    frames (seeded draws, masks, logprobs) are those of a runner that never waited."""
    from fastdeploy.worker import model_runner, warmup
    from tests.engine.test_sampler_warm_up import BackgroundJob

    job = BackgroundJob()
    monkeypatch.setattr(model_runner, "start_sampler_compile", lambda vocab_size, device: [job.future])
    monkeypatch.setattr(warmup, "CACHED_COMPILE_WAIT_S", 0.05)
    runner = _runner(model_dir)
    first = runner.sampler
    assert runner._pending_sampler is not None
    frames = _run(runner, halves=True, num_steps=2)
    assert runner.sampler is first  # still compiling: no switch
    job.finish()
    last: list[int] = [r.token_ids[-1] for r in split_by_sequence(unpack_step_frame(frames[-1]))]
    for n in range(2, 4):
        output = runner.execute(_step(n, last))
        output.wait_mask_ids()
        frames.append(bytes(output.frame))
        last = [r.token_ids[-1] for r in split_by_sequence(unpack_step_frame(output.frame))]
    assert runner.sampler is not first and runner._pending_sampler is None
    monkeypatch.undo()
    assert frames == _run(_runner(model_dir), halves=True, num_steps=4)


def test_a_step_finished_inside_the_next_launch_is_handed_out_there(model_dir) -> None:
    """A penalised row reads its output so far: launching the step sent ahead finishes the step
    before it early, and `on_finished_early` gets that step before the launch returns (the
    worker process sends its frame from there). The frames are those of steps run in turn."""
    penalised = [SamplingParams(top_p=0.9, seed=3, repetition_penalty=1.3), SamplingParams(temperature=0.0)]
    news = [NewSequence(i, PROMPT[: 4 + i], p, return_sampling_mask=True) for i, p in enumerate(penalised)]

    def step(n: int, last: list[int], followed: bool) -> StepInput:
        if n == 0:
            chunks = [ChunkInput(i, PROMPT[: 4 + i], 0, BLOCKS[i], True) for i in range(2)]
            return StepInput(0, news, chunks, [], followed=followed)
        return StepInput(n, [], [ChunkInput(i, [last[i]], 4 + i + n - 1, BLOCKS[i], True) for i in range(2)], [],
                         followed=followed)

    in_turn = _runner(model_dir)
    want: list[bytes] = []
    last: list[int] = []
    for n in range(4):
        output = in_turn.execute(step(n, last, followed=False))
        output.wait_mask_ids()
        want.append(bytes(output.frame))
        last = [r.token_ids[-1] for r in split_by_sequence(unpack_step_frame(output.frame))]

    runner = _runner(model_dir)
    handed: list[tuple[InFlightStep, int]] = []
    launches = 0
    runner.on_finished_early = lambda ahead: handed.append((ahead, launches))
    ahead = runner.launch(step(0, [], followed=True))
    got: list[bytes] = []
    for n in range(1, 4):
        launches = n
        behind = runner.launch(step(n, [IN_FLIGHT_TOKEN] * 2, followed=n < 3))
        assert handed[-1] == (ahead, n), "the step ahead was handed out inside the launch behind it"
        output = runner.finish(ahead)  # already finished: its output as handed out
        output.wait_mask_ids()
        got.append(bytes(output.frame))
        ahead = behind
    output = runner.finish(ahead)
    output.wait_mask_ids()
    got.append(bytes(output.frame))
    assert got == want


def test_shutdown_lets_the_kv_cache_and_step_tensors_go(model_dir):
    """After `shutdown` the runner no longer holds its KV cache or its last steps' tensors, so an
    engine made next in the process finds that memory free, while the `LLM` is still referenced."""
    import weakref

    from fastdeploy.model_executor.model_loader.embedded import embedded_model_path

    llm = LLM(model_dir, tokenizer=embedded_model_path(), device="cpu", dtype="float32", guided_decoding_backend="off",
              max_num_seqs=4, num_kv_blocks=64, async_scheduling="on")
    llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    runner = llm.engine.executor.runner
    held = [weakref.ref(t) for t in runner.kv_caches]
    llm.engine.shutdown()
    assert all(ref() is None for ref in held)
    assert runner._last_sampled is None and runner._latest is None
