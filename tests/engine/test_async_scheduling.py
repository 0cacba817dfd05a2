"""Asynchronous scheduling: step N+1 is scheduled and sent before step N's frame is read, its
in-flight tokens taken from step N's sampler output inside the worker. Whatever the mix of
requests (seeded sampling, logprobs, sampling masks, stop tokens, aborts, preemption,
penalties, structured output, a kept set the GPU kernel leaves unsettled), every request gets
exactly what the engine gives with steps in turn, and the steps did overlap.
"""

from __future__ import annotations

import dataclasses
import json
import random

import pytest
import torch

from fastdeploy import LLM
from fastdeploy.common.config import CacheConfig, EngineConfig, SchedulerConfig, pipelines_steps
from fastdeploy.common.guided_spec import GuidedSpec
from fastdeploy.common.ipc import make_ipc_dir
from fastdeploy.common.request import EngineRequest
from fastdeploy.common.sampling_params import SamplingParams
from fastdeploy.common.speculative_config import SpeculativeConfig
from fastdeploy.common.step_input import IN_FLIGHT_TOKEN, StepInput
from fastdeploy.engine.args import EngineArgs
from fastdeploy.engine.engine_core import EngineCore
from fastdeploy.engine.executor import InProcessExecutor, LocalStep, WorkerProcessExecutor
from fastdeploy.model_executor.layers.sample.sampler import UNSETTLED_TOKEN
from fastdeploy.scheduler.draft_policy import FixedDraftCap
from tests.random_qwen2 import save_random_qwen2

VOCAB = 2_000

# (sampling settings, max_tokens): seeded, finishing at different steps, some on a stop token.
MIXES = [
    ({"top_p": 0.9, "seed": 11, "return_sampling_mask": True}, 9),
    ({"top_k": 50, "temperature": 0.8, "seed": 12, "logprobs": 3}, 4),
    ({"temperature": 0.0, "logprobs": 2}, 12),
    ({"top_p": 0.95, "min_p": 0.01, "seed": 13, "stop_token_ids": [1199]}, 20),
    ({"temperature": 1.0, "seed": 14}, 1),
    ({"top_k": 400, "top_p": 0.8, "seed": 15, "return_sampling_mask": True}, 15),
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return save_random_qwen2(tmp_path_factory.mktemp("qwen2_async"), vocab_size=VOCAB)


# The CUDA runs take the device's own path: frames packed on a stream beside the next step, the
# kept-set kernels that may leave a row unsettled.
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA")])]


def _config(model_dir: str, mode: str, num_blocks: int = 256, device: str = "cpu") -> EngineConfig:
    return EngineConfig(model=model_dir, device=device, dtype="float32", guided_decoding_backend="off",
                        enable_keep_sampling_mask=True, async_scheduling=mode,
                        cache=CacheConfig(block_size=4, num_blocks=num_blocks),
                        scheduler=SchedulerConfig(max_num_seqs=8, max_model_len=64, max_num_batched_tokens=64))


class RecordingExecutor(InProcessExecutor):
    """The CPU runner; records each step as sent."""

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        self.sent: list[StepInput] = []

    def submit(self, step: StepInput) -> LocalStep:
        self.sent.append(step)
        return super().submit(step)


def _requests(extra: dict | None = None) -> list[EngineRequest]:
    g = torch.Generator().manual_seed(5)
    requests = []
    for i, (mix, max_tokens) in enumerate(MIXES):
        prompt = torch.randint(12, VOCAB, (3 + 4 * i,), generator=g).tolist()
        params = SamplingParams(max_tokens=max_tokens, **{**mix, **(extra if i == 2 and extra else {})})
        requests.append(EngineRequest(f"r{i}", prompt, params, 0.0))
    return requests


def _run(core: EngineCore, requests: list[EngineRequest], abort_after: dict[str, int] | None = None) -> dict:
    """Per request: tokens, logprobs, masks, finish reason. `abort_after[r] = n` aborts r once
    n of its tokens are out."""
    for request in requests:
        core.add_request(request)
    # A frame carries logprobs for every row once one row asks: read only the askers'.
    asked = {r.request_id for r in requests if r.params.logprobs is not None}
    out: dict[str, dict] = {r.request_id: {"tokens": [], "logprobs": [], "masks": [], "finish": None}
                            for r in requests}
    try:
        while core.has_work():
            for d in core.step():
                got = out[d.request_id]
                assert got["finish"] is None, f"{d.request_id}: a delta after its finish"
                got["tokens"] += d.token_ids
                if d.request_id in asked:
                    got["logprobs"] += d.logprobs or []
                if d.sampling_mask is not None:
                    got["masks"] += d.sampling_mask.to_lists()
                if d.finish_reason is not None:
                    got["finish"] = d.finish_reason
                elif abort_after and len(got["tokens"]) >= abort_after.get(d.request_id, 1 << 30):
                    core.abort([d.request_id])
                    got["finish"] = "abort"
        assert core.block_manager.num_free_blocks == core.block_manager.num_blocks, "blocks left held"
    finally:
        core.shutdown()
    return out


def _assert_same(got: dict, want: dict) -> None:
    """Tokens, masks and finish reasons exactly; logprobs to float32 rounding, since a step sent
    ahead may still hold a row of a sequence that has just finished, so the others' matrix
    products run at another row count."""
    assert got.keys() == want.keys()
    for request_id, g in got.items():
        w = want[request_id]
        assert (g["tokens"], g["masks"], g["finish"]) == (w["tokens"], w["masks"], w["finish"]), request_id
        assert [len(row) for row in g["logprobs"]] == [len(row) for row in w["logprobs"]], request_id
        flat = [[v for row in r["logprobs"] for v in row] for r in (g, w)]
        torch.testing.assert_close(torch.tensor(flat[0]), torch.tensor(flat[1]), atol=1e-4, rtol=0)


def _pipelined(sent: list[StepInput]) -> tuple[int, int]:
    """(steps sent before the frame of the one ahead of them was read, in-flight tokens sent)."""
    return (sum(step.followed for step in sent),
            sum(c.token_ids[-1] == IN_FLIGHT_TOKEN for step in sent for c in step.chunks))


def _both(model_dir: str, requests_of, num_blocks: int = 256, abort_after: dict[str, int] | None = None,
          device: str = "cpu"):
    off = _config(model_dir, "off", num_blocks, device)
    plain = _run(EngineCore(off, InProcessExecutor(off)), requests_of(), abort_after)
    config = _config(model_dir, "on", num_blocks, device)
    executor = RecordingExecutor(config)
    core = EngineCore(config, executor)
    return plain, _run(core, requests_of(), abort_after), executor.sent, core


@pytest.mark.parametrize("device", DEVICES)
def test_pipelined_steps_give_what_steps_in_turn_give(model_dir, device) -> None:
    plain, pipelined, sent, _ = _both(model_dir, _requests, device=device)
    _assert_same(pipelined, plain)
    if device == "cpu":  # r3's stop token is where the CPU's draws put it
        assert {r["finish"] for r in plain.values()} >= {"length", "stop"}
    followed, in_flight = _pipelined(sent)
    assert followed >= 10 and in_flight >= 30, (followed, in_flight)


@pytest.mark.parametrize("device", DEVICES)
def test_aborts_and_finishes_drop_the_token_computed_ahead(model_dir, device) -> None:
    """An aborted or finished sequence's row in the step already sent is dropped, its blocks
    come back, and no other request notices."""
    abort_after = {"r0": 3, "r5": 6}
    plain, pipelined, sent, _ = _both(model_dir, _requests, abort_after=abort_after, device=device)
    _assert_same(pipelined, plain)
    assert pipelined["r0"]["finish"] == pipelined["r5"]["finish"] == "abort"
    assert _pipelined(sent)[0] > 0


def test_a_short_pool_preempts_in_turn(model_dir) -> None:
    """With too few blocks for every sequence, a step scheduled ahead leaves out a sequence that
    does not fit (its token is in flight) and is followed by a step in turn, which preempts."""
    plain, pipelined, sent, core = _both(model_dir, _requests, num_blocks=18)
    _assert_same(pipelined, plain)
    assert core.scheduler.num_preemptions > 0
    assert _pipelined(sent)[0] > 0


@pytest.mark.parametrize("device", DEVICES)
def test_a_penalised_request_pipelines_too(model_dir, device) -> None:
    """Penalties count the output so far on the worker's host: the worker finishes the step
    ahead of the one it launches (beside that one's forward pass) before it builds the
    penalised rows' histories, and the steps still go out ahead."""
    plain, pipelined, sent, _ = _both(model_dir, lambda: _requests({"repetition_penalty": 1.3,
                                                                   "frequency_penalty": 0.5}), device=device)
    _assert_same(pipelined, plain)
    followed, in_flight = _pipelined(sent)
    assert followed >= 10 and in_flight >= 30, (followed, in_flight)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("penalised", [False, True], ids=["sent-after-launch", "sent-inside-launch"])
def test_the_worker_process_overlaps_steps_too(model_dir, device, penalised) -> None:
    """The server's layout: the worker launches the step sent ahead before it sends the frame owed;
    a penalised row has that frame finished, and sent, inside the launch."""
    extra = {"repetition_penalty": 1.3, "frequency_penalty": 0.5} if penalised else None
    off = _config(model_dir, "off", device=device)
    plain = _run(EngineCore(off, InProcessExecutor(off)), _requests(extra))
    config = _config(model_dir, "on", device=device)
    pipelined = _run(EngineCore(config, WorkerProcessExecutor(config, make_ipc_dir())), _requests(extra))
    _assert_same(pipelined, plain)


def test_structured_output_pipelines_and_holds_the_schema() -> None:
    """Grammars advance on the worker's host: each step ahead finishes the one before it early
    (its forward pass already queued), so constrained requests keep their outputs, and valid
    JSON, with steps sent ahead."""
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                               "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    prompts = [[{"role": "user", "content": f"Describe person number {i} as JSON."}] for i in range(4)]

    def run(mode: str) -> tuple[list[str], list[StepInput]]:
        llm = LLM(async_scheduling=mode, max_num_seqs=8)
        sent: list[StepInput] = []
        submit = llm.engine.executor.submit

        def recording_submit(step: StepInput):
            sent.append(step)
            return submit(step)

        llm.engine.executor.submit = recording_submit  # type: ignore[method-assign]
        try:
            outs = llm.chat(prompts, [SamplingParams(temperature=0.8, seed=30 + i, max_tokens=48,
                                                     guided=GuidedSpec("json_schema", json.dumps(schema))) if i % 2 == 0
                                      else SamplingParams(temperature=0.8, seed=30 + i, max_tokens=48)
                                      for i in range(len(prompts))])
        finally:
            llm.engine.shutdown()
        return [o.outputs[0].text for o in outs], sent

    plain, _ = run("off")
    pipelined, sent = run("on")
    assert pipelined == plain
    for text in pipelined[0::2]:
        value = json.loads(text)
        assert set(value) == {"name", "age"} and isinstance(value["age"], int)
    assert _pipelined(sent)[0] >= 10


class UnsettlingSampler:
    """The CPU sampler, but the first truncating row of every third call is marked unsettled, as
    the GPU kept-set kernel may leave a row: the runner then samples the step again, and a step
    launched behind it that read the marker as its in-flight token runs again."""

    def __init__(self, sampler) -> None:
        self.sampler = sampler
        self.leaves_unsettled = True
        self.calls = 0
        self.unsettled = 0

    def __call__(self, logits, meta, settle_kept_sets: bool = False):
        out = self.sampler(logits, meta, settle_kept_sets)
        if settle_kept_sets:
            return out
        self.calls += 1
        truncated = meta.row_groups.host[1]
        if truncated and self.calls % 3 == 0:
            out.sampled_token_ids[truncated[0]] = UNSETTLED_TOKEN
            self.unsettled += 1
        return out


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("penalised", [False, True], ids=["relaunched", "finished-early"])
def test_a_redrawn_token_runs_the_step_sent_ahead_again(model_dir, monkeypatch, device, penalised) -> None:
    """Without penalties the step behind has sampled when the redraw comes, and is launched
    again; with a penalised row it finishes the step ahead early, before it samples, and runs
    its own forward pass again."""
    extra = {"repetition_penalty": 1.2} if penalised else None
    off = _config(model_dir, "off", device=device)
    plain = _run(EngineCore(off, InProcessExecutor(off)), _requests(extra))
    config = _config(model_dir, "on", device=device)
    executor = RecordingExecutor(config)
    runner = executor.runner
    sampler = UnsettlingSampler(runner.sampler)
    runner.sampler = sampler
    relaunches = []
    relaunch = runner._relaunch

    def counting_relaunch(successor, tokens, redrawn) -> None:
        relaunches.append(successor.sampling)
        relaunch(successor, tokens, redrawn)
        if successor.sampling is not relaunches[-1]:
            relaunches[-1] = "ran again"

    forwards_per_launch: list[int] = []
    inside_launch = [False]
    forward, launch = runner._forward, runner.launch

    def counting_forward(*args):
        forwards_per_launch[-1] += inside_launch[0]
        return forward(*args)

    def counting_launch(step):
        forwards_per_launch.append(0)
        inside_launch[0] = True
        try:
            return launch(step)
        finally:
            inside_launch[0] = False

    monkeypatch.setattr(runner, "_relaunch", counting_relaunch)
    monkeypatch.setattr(runner, "_forward", counting_forward)
    monkeypatch.setattr(runner, "launch", counting_launch)
    _assert_same(_run(EngineCore(config, executor), _requests(extra)), plain)
    assert sampler.unsettled >= 3
    assert relaunches.count("ran again") >= 1, relaunches  # a step behind had sampled: launched again
    # While the penalised request runs, the launch behind finishes the redrawn step early and
    # runs its own forward pass again.
    assert (max(forwards_per_launch) == 2) == penalised, forwards_per_launch


def test_modes_and_what_refuses_them() -> None:
    cpu = EngineConfig(device="cpu")
    cuda = dataclasses.replace(cpu, device="cuda")
    assert not pipelines_steps(cpu) and pipelines_steps(cuda)
    assert pipelines_steps(dataclasses.replace(cpu, async_scheduling="on"))
    assert not pipelines_steps(dataclasses.replace(cuda, async_scheduling="off"))
    assert pipelines_steps(dataclasses.replace(cuda, tensor_parallel_size=2))  # rank 0 broadcasts the tokens
    assert pipelines_steps(EngineArgs(async_scheduling="on", tensor_parallel_size=2).create_engine_config())
    for method in ("ngram", "mtp"):
        for adaptive in (True, False):  # fixed drafts too: their verify steps are drafted on the device
            spec = SpeculativeConfig(method=method, num_speculative_tokens=2, adaptive=adaptive)
            assert pipelines_steps(dataclasses.replace(cuda, speculative=spec))
            assert not pipelines_steps(dataclasses.replace(cpu, speculative=spec))
            assert pipelines_steps(EngineArgs(async_scheduling="on", speculative_config={
                "method": method, "num_speculative_tokens": 2, "adaptive": adaptive}).create_engine_config())
    with pytest.raises(ValueError, match="unknown async_scheduling"):
        EngineArgs(async_scheduling="sometimes").create_engine_config()


def test_the_server_refuses_an_unknown_mode(capsys) -> None:
    """A usage error before anything starts."""
    from fastdeploy.entrypoints.openai.api_server import make_parser

    with pytest.raises(SystemExit):  # argparse: not a mode
        make_parser().parse_args(["--async-scheduling", "sometimes"])
    assert "--async-scheduling" in make_parser().format_help()


class ScriptedCaps:
    """A draft policy whose caps follow a fixed script (then none), so steps with and without
    drafts alternate in a known pattern; records what it was asked and told."""

    def __init__(self, script: list[int]) -> None:
        self.script = script
        self.calls = 0
        # (cap, tokens, sent ahead, the step after it takes drafts) of each measured step
        self.observed: list[tuple[int, int, bool, bool]] = []

    def cap(self, num_rows: int) -> int:
        cap = self.script[self.calls] if self.calls < len(self.script) else 0
        self.calls += 1
        return cap

    def observe(self, num_rows: int, cap: int, num_tokens: int, seconds: float, sent_ahead: bool = False,
                drafted_next: bool = False) -> None:
        assert seconds > 0
        self.observed.append((cap, num_tokens, sent_ahead, drafted_next))

    def describe(self) -> str:
        return "scripted"


def _record_host_drafts(monkeypatch) -> dict[str, dict[tuple[int, int], list[int]]]:
    """drafts[mode][(seq_id, position of its newest token)]: the drafts each step made on the host,
    per async_scheduling mode; a test adds the device's drafts under "on" itself."""
    from fastdeploy.worker.model_runner import ModelRunner

    drafted: dict[str, dict[tuple[int, int], list[int]]] = {"off": {}, "on": {}}
    propose_drafts = ModelRunner._propose_drafts

    def recording(self, chunks, predecessor):
        drafts = propose_drafts(self, chunks, predecessor)
        if predecessor is None or predecessor.drafts is None:
            drafted[self.config.async_scheduling].update(
                {(c.seq_id, c.start): drafts[c.seq_id] for c in chunks if c.seq_id in drafts})
        return drafts

    monkeypatch.setattr(ModelRunner, "_propose_drafts", recording)
    return drafted


def _assert_same_drafts(drafted: dict[str, dict[tuple[int, int], list[int]]], at_least: int) -> None:
    """Wherever both runs drafted for a sequence at a position (at least `at_least` times), the
    drafts agree as far as both go."""
    both = drafted["off"].keys() & drafted["on"].keys()
    assert len(both) >= at_least, (sorted(drafted["off"]), sorted(drafted["on"]))
    for key in both:
        n = min(len(drafted["off"][key]), len(drafted["on"][key]))
        assert drafted["on"][key][:n] == drafted["off"][key][:n], key


@pytest.mark.parametrize("device", DEVICES)
def test_adaptive_ngram_sends_steps_ahead_with_and_without_drafts(predictable_dir, monkeypatch, device) -> None:
    """n-gram's steps go out ahead whatever their drafts: the worker keeps the context on the
    device, finds each verify step's accepted drafts there, moves the step sent after it on by
    them and looks its drafts up there. Wherever the in-turn run (drafts from the host's
    context) drafts for a sequence at a position, the device drafted the same tokens, and the
    greedy text is that of decoding without speculation."""
    from fastdeploy.worker.model_runner import ModelRunner

    model_dir = predictable_dir
    off = _config(model_dir, "off", device=device)
    seeds = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [9, 10, 11, 9, 10, 11, 9, 10], [12, 13, 14, 15, 16]]

    def requests(prompts: list[list[int]], max_tokens: int = 20) -> list[EngineRequest]:
        return [EngineRequest(f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=2), 0.0)
                for i, p in enumerate(prompts)]

    # This model's next token is mostly a function of the token: a prompt that holds its own
    # continuation (seed, what decoding wrote after it, the seed again) is continued much as
    # before, which lookup drafting finds in the prompt.
    first = _run(EngineCore(off, InProcessExecutor(off)), requests(seeds, 16))
    prompts = [seed + first[f"r{i}"]["tokens"] + seed for i, seed in enumerate(seeds)]
    drafted = _record_host_drafts(monkeypatch)
    drafts_ahead = ModelRunner._ngram_drafts_ahead

    def recording_device(self, positions, meta, newest, verified, cap):
        drafts = drafts_ahead(self, positions, meta, newest, verified, cap)
        starts = torch.arange(len(newest)) if verified is None else verified.rows[:, 0].cpu()
        accepted = 1 if verified is None else verified.accepted.cpu().long()
        newest_at = (positions.cpu()[starts] + accepted).tolist()
        seq_ids = self._last_sampled.seq_ids
        for seq_id, at, row in zip(seq_ids, newest_at, drafts.tolist(), strict=True):
            drafted["on"][(seq_id, at)] = row
        return drafts

    monkeypatch.setattr(ModelRunner, "_ngram_drafts_ahead", recording_device)
    plain = _run(EngineCore(off, InProcessExecutor(off)), requests(prompts))
    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=3, prompt_lookup_min=1, prompt_lookup_max=3)
    script = [0, 0, 0, 0, 0, 3, 3, 0, 0, 0, 0, 2, 0, 0, 3, 3, 3, 1, 0, 3] * 3
    results, stats = {}, {}
    for mode in ("off", "on"):
        config = dataclasses.replace(_config(model_dir, mode, device=device), speculative=spec)
        executor = RecordingExecutor(config)
        core = EngineCore(config, executor)
        policy = ScriptedCaps(list(script))
        core.draft_policy = policy  # type: ignore[assignment]
        results[mode] = _run(core, requests(prompts))
        stats[mode] = core.spec_stats
    _assert_same(results["off"], plain)
    _assert_same(results["on"], plain)
    assert stats["on"].num_accepted_draft_tokens >= 5, stats
    # How the steps ran: none ahead in turn; ahead, verify steps among them (counted per frame).
    assert stats["off"].num_steps_ahead == 0 and stats["on"].num_steps_ahead >= 10, stats
    for mode in ("off", "on"):
        st = stats[mode]
        assert 0 < st.num_verify_steps < st.num_steps and 1 <= st.num_steps_with_prefill < st.num_steps, stats
    # Lookups that came up short are not counted as drafts: these prompts' drafts mostly hold.
    for mode in ("off", "on"):
        assert stats[mode].num_accepted_draft_tokens >= 0.7 * stats[mode].num_draft_tokens, stats
    followed, in_flight = _pipelined(executor.sent)
    verified_ahead = [step for step in executor.sent
                      if any(c.num_lookahead and IN_FLIGHT_TOKEN in c.token_ids for c in step.chunks)]
    assert followed >= 10 and in_flight >= 20 and len(verified_ahead) >= 4, (followed, in_flight, len(verified_ahead))
    assert any(ahead for cap, _, ahead, _ in policy.observed if cap > 0)
    # Steps without drafts are told apart by whether the step after them takes drafts.
    assert {drafted_next for cap, _, _, drafted_next in policy.observed if cap == 0} == {False, True}
    _assert_same_drafts(drafted, at_least=4)


@pytest.fixture(scope="module")
def predictable_dir(tmp_path_factory) -> str:
    """A model whose next token is mostly a function of the token itself (its layers write into
    the residual stream at a small scale), the context still moving its logits: drafts of a head
    that computes that function are mostly accepted, and K/V read from a wrong place show."""
    return save_random_qwen2(tmp_path_factory.mktemp("qwen2_predictable"), vocab_size=VOCAB, write_scale=5e-4)


@pytest.fixture(scope="module")
def mtp_head_dir(predictable_dir, tmp_path_factory) -> str:
    """An MTP head for `predictable_dir` that predicts its next token: the head passes the token's
    embedding on (its hidden input unused) and its block writes at the same small scale."""
    from fastdeploy.model_executor.models.mtp import MTPHead, mtp_config, save_mtp_head
    from fastdeploy.worker.model_runner import ModelRunner

    torch.manual_seed(4)
    model_config = ModelRunner(_config(predictable_dir, "off")).model_config
    head = MTPHead(mtp_config(model_config))
    hidden = model_config.hidden_size
    with torch.no_grad():
        head.enorm.weight.fill_(1.0)
        head.eh_proj.weight.zero_()
        head.eh_proj.weight[:, :hidden] = torch.eye(hidden)
        for weight in (head.layer.self_attn.o_proj.weight, head.layer.mlp.down_proj.weight):
            weight.mul_(5e-4 / weight.std())
    head_dir = str(tmp_path_factory.mktemp("mtp_async"))
    save_mtp_head(head, head_dir, dtype=torch.float32)
    return head_dir


# Caps the scripted policy gives, step after step: runs without drafts, with 2, with 1.
MTP_SCRIPT = [0, 0, 0, 0, 0, 2, 2, 0, 0, 0, 0, 1, 0, 0, 2, 2, 2, 1, 0, 2] * 3


def _mtp_core(model_dir: str, head_dir: str, mode: str, device: str = "cpu") -> tuple[EngineCore, RecordingExecutor]:
    spec = SpeculativeConfig(method="mtp", num_speculative_tokens=2, model=head_dir)
    config = dataclasses.replace(_config(model_dir, mode, device=device), speculative=spec)
    executor = RecordingExecutor(config)
    core = EngineCore(config, executor)
    core.draft_policy = ScriptedCaps(list(MTP_SCRIPT))  # type: ignore[assignment]
    return core, executor


@pytest.mark.parametrize("device", DEVICES)
def test_adaptive_mtp_sends_steps_ahead_with_and_without_drafts(predictable_dir, mtp_head_dir, monkeypatch,
                                                                device) -> None:
    """MTP's steps go out ahead whatever their drafts: the worker finds each verify step's
    accepted drafts on the device, moves the step sent after it on by them, and the MTP module
    drafts for that step there too (a step without drafts feeds the module at its launch). The
    module's K/V are what the in-turn path writes: wherever both runs draft for a sequence at a
    position, the drafts are the same (a random head, greedy), and the text is that of decoding
    without speculation."""
    from fastdeploy.worker.mtp_step import MTPStep

    model_dir = predictable_dir
    off = _config(model_dir, "off", device=device)
    prompts = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [9, 10, 11, 9, 10, 11, 9, 10], [12, 13, 14, 15, 16]]

    def requests() -> list[EngineRequest]:
        return [EngineRequest(f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=24, logprobs=3), 0.0)
                for i, p in enumerate(prompts)]

    plain = _run(EngineCore(off, InProcessExecutor(off)), requests())
    drafted = _record_host_drafts(monkeypatch)
    calls = {"fill": 0, "draft": 0}
    feed_in_flight = MTPStep.feed_in_flight
    draft_in_flight = MTPStep.draft_in_flight

    def counting_fill(self, *args, **kwargs):
        calls["fill"] += 1
        return feed_in_flight(self, *args, **kwargs)

    def recording_device(self, chunks, sequences, hidden, positions, meta, row_tokens, seq_ids, starts, accepted, cap):
        calls["draft"] += 1
        drafts = draft_in_flight(self, chunks, sequences, hidden, positions, meta, row_tokens, seq_ids, starts,
                                 accepted, cap)
        if drafts is not None:
            # Keyed by where the step after drafts them: the position after the newest token.
            rows = torch.tensor(starts) + (0 if accepted is None else accepted.cpu().long() - 1)
            for seq_id, at, row in zip(seq_ids, positions.cpu()[rows].tolist(), drafts.tolist(), strict=True):
                drafted["on"][(seq_id, at + 1)] = row
        return drafts

    monkeypatch.setattr(MTPStep, "feed_in_flight", counting_fill)
    monkeypatch.setattr(MTPStep, "draft_in_flight", recording_device)
    core, _ = _mtp_core(model_dir, mtp_head_dir, "off", device)
    in_turn = _run(core, requests())
    assert calls == {"fill": 0, "draft": 0}
    core, executor = _mtp_core(model_dir, mtp_head_dir, "on", device)
    pipelined = _run(core, requests())
    _assert_same(in_turn, plain)
    _assert_same(pipelined, plain)
    # Accepted drafts in steps sent ahead: their successors were moved on, on the device.
    assert core.spec_stats.num_accepted_draft_tokens >= 10, core.spec_stats
    sent = executor.sent
    followed, in_flight = _pipelined(sent)
    verified_ahead = [step for step in sent
                      if any(c.num_lookahead and IN_FLIGHT_TOKEN in c.token_ids for c in step.chunks)]
    followed_verifying = [step for step in sent if step.followed and any(c.num_lookahead for c in step.chunks)]
    assert followed >= 10 and in_flight >= 20, (followed, in_flight)
    assert len(verified_ahead) >= 4 and len(followed_verifying) >= 4, (len(verified_ahead), len(followed_verifying))
    assert calls["draft"] >= 6 and calls["fill"] >= 1, calls
    _assert_same_drafts(drafted, at_least=6)


@pytest.mark.parametrize("device", DEVICES)
def test_mtp_drafts_ahead_keep_every_request_as_in_turn(predictable_dir, mtp_head_dir, device) -> None:
    """Seeded sampling, logprobs, sampling masks and a stop token under MTP: with verify steps
    sent ahead every request gets what the same caps give in turn. Near max_tokens a step sent
    ahead may take fewer drafts (the host does not know yet how many the step before accepted,
    so it counts them all), and a seeded row's later draws follow its draft layout: the last
    2 (k + 1) tokens of a sampled row may differ; a greedy row's may not."""
    import msgspec

    def requests() -> list[EngineRequest]:
        out = _requests()
        for request in out:
            request.params = msgspec.structs.replace(request.params, max_tokens=24)
        return out

    core, _ = _mtp_core(predictable_dir, mtp_head_dir, "off", device)
    in_turn = _run(core, requests())
    core, executor = _mtp_core(predictable_dir, mtp_head_dir, "on", device)
    pipelined = _run(core, requests())
    assert core.spec_stats.num_accepted_draft_tokens >= 5, core.spec_stats
    assert any(step.followed and any(c.num_lookahead for c in step.chunks) for step in executor.sent)
    for request_id, want in in_turn.items():
        got = pipelined[request_id]
        cut = len(want["tokens"]) - (0 if request_id == "r2" else 6)  # r2: greedy
        assert cut >= 10 and got["tokens"][:cut] == want["tokens"][:cut], request_id
        assert got["masks"][:cut] == want["masks"][:cut], request_id
        torch.testing.assert_close(torch.tensor(got["logprobs"][:cut]), torch.tensor(want["logprobs"][:cut]),
                                   atol=1e-4, rtol=0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("method", ["ngram", "mtp"])
def test_fixed_drafts_send_their_verify_steps_ahead(predictable_dir, mtp_head_dir, device, method) -> None:
    """`"adaptive": false` with steps overlapped: every decode step verifies the configured
    drafts, made on the device, and goes out ahead of the running one; the greedy text and
    logprobs are those of decoding without speculation."""
    seeds = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [9, 10, 11, 9, 10, 11, 9, 10], [12, 13, 14, 15, 16]]

    def requests(prompts: list[list[int]], max_tokens: int = 24) -> list[EngineRequest]:
        return [EngineRequest(f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=2), 0.0)
                for i, p in enumerate(prompts)]

    # Prompts that hold their own continuation (as in the adaptive n-gram test): lookups find it.
    off = _config(predictable_dir, "off", device=device)
    first = _run(EngineCore(off, InProcessExecutor(off)), requests(seeds, 16))
    prompts = [seed + first[f"r{i}"]["tokens"] + seed for i, seed in enumerate(seeds)]
    plain = _run(EngineCore(off, InProcessExecutor(off)), requests(prompts))
    spec = SpeculativeConfig(method=method, num_speculative_tokens=2, adaptive=False, prompt_lookup_min=1,
                             prompt_lookup_max=3, model=mtp_head_dir if method == "mtp" else None)
    config = dataclasses.replace(_config(predictable_dir, "on", device=device), speculative=spec)
    executor = RecordingExecutor(config)
    core = EngineCore(config, executor)
    assert isinstance(core.draft_policy, FixedDraftCap) and core.draft_policy.describe() == "fixed at 2"
    _assert_same(_run(core, requests(prompts)), plain)
    stats = core.spec_stats
    assert stats.num_accepted_draft_tokens >= 5, stats
    # Every decode step reserved the drafts' rows and announced the fixed cap; verify steps went
    # out ahead of the running one (which only the device's drafting allows).
    assert {step.next_draft_cap for step in executor.sent} == {2}
    with_drafts = [step for step in executor.sent if any(c.num_lookahead for c in step.chunks)]
    assert len(with_drafts) >= 10 and sum(step.followed for step in with_drafts) >= len(with_drafts) - 3
    assert stats.num_verify_steps >= 5 and stats.num_steps_ahead >= stats.num_steps - 3, stats


def test_mtp_drafts_ahead_at_the_context_end_in_a_short_pool_and_on_abort(predictable_dir, mtp_head_dir) -> None:
    """Verify steps sent ahead where they are hardest: a sequence that reaches the context length
    (64) with drafts in flight, a pool too small for every sequence (a step ahead leaves one out,
    the step after it preempts), and aborts. Greedy text, logprobs and finish reasons are those
    of decoding without speculation, and every block comes back."""
    g = torch.Generator().manual_seed(7)

    def requests() -> list[EngineRequest]:
        lengths = [50, 9, 14, 5, 30]
        return [EngineRequest(f"r{i}", torch.randint(12, VOCAB, (n,), generator=g).tolist(),
                              SamplingParams(temperature=0.0, max_tokens=40, logprobs=2), 0.0)
                for i, n in enumerate(lengths)]

    abort_after = {"r1": 5, "r3": 11}
    off = _config(predictable_dir, "off", num_blocks=22)
    g.manual_seed(7)
    plain = _run(EngineCore(off, InProcessExecutor(off)), requests())
    spec = SpeculativeConfig(method="mtp", num_speculative_tokens=2, model=mtp_head_dir)
    config = dataclasses.replace(_config(predictable_dir, "on", num_blocks=22), speculative=spec)
    executor = RecordingExecutor(config)
    core = EngineCore(config, executor)
    core.draft_policy = ScriptedCaps([2] * 400)  # type: ignore[assignment]
    g.manual_seed(7)
    pipelined = _run(core, requests(), abort_after)
    # An abort lands after the delta that reached its count: with drafts a delta holds several
    # tokens, so an aborted request holds a prefix of its full text, at least that long.
    for request_id, count in abort_after.items():
        got, want = pipelined.pop(request_id), plain.pop(request_id)
        n = len(got["tokens"])
        assert got["finish"] == "abort" and n >= count and got["tokens"] == want["tokens"][:n], request_id
    _assert_same(pipelined, plain)
    assert plain["r0"]["finish"] == "length" and len(plain["r0"]["tokens"]) == 64 - 50
    assert core.spec_stats.num_accepted_draft_tokens >= 10, core.spec_stats
    assert any(step.followed and any(c.num_lookahead for c in step.chunks) for step in executor.sent)
    assert core.scheduler.num_preemptions > 0  # the pool ran short


def test_a_penalised_arrival_behind_a_verify_step_sent_ahead(predictable_dir, mtp_head_dir, monkeypatch) -> None:
    """A penalised request arrives while a verify step runs ahead: the step that admits it
    finishes that verify step inside its own launch (the penalty reads its tokens), and must
    still learn where its rows really ran, since the host-side MTP pass after its frame (the
    step, with a prompt in it, goes in turn) writes the module's K/V at those positions. Every
    host pass over a decode sequence starts at its true position; text is decoding's without
    speculation. The arrival is tried at several points, so that it lands behind a verify step
    that accepted drafts."""
    from fastdeploy.worker import model_runner
    from fastdeploy.worker.mtp_step import MTPStep

    feed = MTPStep.feed
    fed: list[tuple[int, int, int]] = []  # (seq_id, chunk start, its newest known token's position)

    def checking(self, chunks, hidden, accepted, drafts, sequences, max_drafts=None):
        for c in chunks:
            if c.sample and c.seq_id in accepted and c.start > 0:
                state = sequences[c.seq_id]
                known = len(state.prompt_token_ids) + len(state.output_token_ids)
                fed.append((c.seq_id, c.start, known - accepted[c.seq_id] - 1))
        return feed(self, chunks, hidden, accepted, drafts, sequences, max_drafts)

    moved_on = model_runner._moved_on
    moves: list[int] = []  # the most drafts a sequence accepted, per step whose chunks moved on

    def recording(chunks, drafts, counts):
        moves.append(max(counts.values()) - 1)
        return moved_on(chunks, drafts, counts)

    monkeypatch.setattr(MTPStep, "feed", checking)
    monkeypatch.setattr(model_runner, "_moved_on", recording)
    first = EngineRequest("r0", [5, 6, 7, 8, 9, 10, 11], SamplingParams(temperature=0.0, max_tokens=40), 0.0)
    late = EngineRequest("r1", [20, 21, 22, 23], SamplingParams(temperature=0.0, max_tokens=20,
                                                                presence_penalty=1.5), 0.0)
    off = _config(predictable_dir, "off")
    plain = _run(EngineCore(off, InProcessExecutor(off)), [first, late])
    for arrival in range(8, 16):
        core, executor = _mtp_core(predictable_dir, mtp_head_dir, "on")
        core.draft_policy = ScriptedCaps([2] * 400)  # type: ignore[assignment]
        out: dict[str, list[int]] = {"r0": [], "r1": []}
        core.add_request(first)
        try:
            while core.has_work():
                for delta in core.step():
                    out[delta.request_id] += delta.token_ids
                if len(out["r0"]) >= arrival and "r1" not in core.by_request_id and not out["r1"]:
                    core.add_request(late)
        finally:
            core.shutdown()
        assert out == {r: plain[r]["tokens"] for r in out}, arrival
        assert any(step.followed and any(c.num_lookahead for c in step.chunks) for step in executor.sent)
    assert fed and all(start == true for _, start, true in fed), fed
    assert any(n > 0 for n in moves), moves  # some arrival landed behind accepted drafts


class _RandomCaps(ScriptedCaps):
    """Caps drawn from a seeded generator (mostly the most drafts), forever."""

    def __init__(self, seed: int) -> None:
        super().__init__([])
        self.rng = random.Random(seed)

    def cap(self, num_rows: int) -> int:
        return self.rng.choice([0, 1, 2, 2, 2])


def _random_schedule(seed: int, model_dir: str, spec: SpeculativeConfig | None,
                     chains: list[list[int]] | None = None) -> tuple[dict[str, tuple[list[int], str | None]], int]:
    """One random workload (arrivals over the first steps, prompt and answer lengths, presence
    penalties, logprobs, aborts, a pool from tight to roomy), greedy; per request its tokens and
    finish reason, and the drafts accepted. `spec`: speculation with random caps and steps sent
    ahead; None: none.
    `chains`: texts the model writes; each prompt is then a piece of one followed by the start
    of that piece again, so the model's continuation stands in the prompt (lookup drafts hit)."""
    rng = random.Random(seed)
    arrivals = []
    for i in range(rng.randint(1, 6)):
        params: dict = {"temperature": 0.0, "max_tokens": rng.randint(1, 40)}
        if rng.random() < 0.2:
            params["presence_penalty"] = 1.0
        if rng.random() < 0.2:
            params["logprobs"] = 2
        if chains is None:
            prompt = [rng.randint(12, VOCAB - 1) for _ in range(rng.randint(2, 40))]
        else:
            chain = rng.choice(chains)
            first = rng.randint(0, len(chain) - 8)
            piece = chain[first:first + rng.randint(6, min(28, len(chain) - first))]
            prompt = piece + piece[:rng.randint(1, len(piece) - 1)]
        arrivals.append((rng.randint(0, 12), EngineRequest(f"r{i}", prompt, SamplingParams(**params), 0.0)))
    aborts = {request.request_id: rng.randint(1, 20) for _, request in arrivals if rng.random() < 0.2}
    config = _config(model_dir, "off" if spec is None else "on", num_blocks=rng.choice([20, 30, 64, 256]))
    config = dataclasses.replace(config, speculative=spec)
    core = EngineCore(config, InProcessExecutor(config))
    if spec is not None:
        core.draft_policy = _RandomCaps(seed)  # type: ignore[assignment]
    out: dict[str, tuple[list[int], str | None]] = {r.request_id: ([], None) for _, r in arrivals}
    arrivals.sort(key=lambda a: a[0])
    step = 0
    try:
        while arrivals or core.has_work():
            while arrivals and arrivals[0][0] <= step:
                core.add_request(arrivals.pop(0)[1])
            for delta in core.step():
                tokens, finish = out[delta.request_id]
                tokens += delta.token_ids
                if delta.finish_reason is not None:
                    finish = delta.finish_reason
                elif len(tokens) >= aborts.get(delta.request_id, 1 << 30) and finish is None:
                    core.abort([delta.request_id])
                    finish = "abort"
                out[delta.request_id] = (tokens, finish)
            step += 1
        assert core.block_manager.num_free_blocks == core.block_manager.num_blocks, "blocks left held"
    finally:
        core.shutdown()
    return out, core.spec_stats.num_accepted_draft_tokens


def test_mtp_drafts_ahead_over_random_workloads(predictable_dir, mtp_head_dir) -> None:
    """Random arrivals, lengths, penalties, aborts and pools, with random caps: greedy text and
    finish reasons under MTP with steps sent ahead are decoding's without speculation (an
    aborted request: a prefix of it, since its abort lands after a delta of several tokens)."""
    _assert_random_workloads(predictable_dir, SpeculativeConfig(method="mtp", num_speculative_tokens=2,
                                                                model=mtp_head_dir))


def test_ngram_drafts_ahead_over_random_workloads(predictable_dir) -> None:
    """The same for n-gram drafting on the device, with prompts that hold the model's own
    continuation, so lookups hit and steps sent ahead accept drafts."""
    off = _config(predictable_dir, "off")
    seeds = [[5, 6, 7, 8], [300, 301], [1500, 40, 41], [999]]
    written = _run(EngineCore(off, InProcessExecutor(off)),
                   [EngineRequest(f"c{i}", p, SamplingParams(temperature=0.0, max_tokens=56), 0.0)
                    for i, p in enumerate(seeds)])
    chains = [seed + written[f"c{i}"]["tokens"] for i, seed in enumerate(seeds)]
    chains = [chain for chain in chains if len(chain) >= 16]  # an early EOS leaves a short one
    assert len(chains) >= 2, chains
    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=2, prompt_lookup_min=1, prompt_lookup_max=3)
    accepted = _assert_random_workloads(predictable_dir, spec, chains)
    assert accepted >= 100, accepted


def _assert_random_workloads(model_dir: str, spec: SpeculativeConfig, chains: list[list[int]] | None = None,
                             seeds: int = 16) -> int:
    """`_random_schedule` with and without `spec` agree over `seeds` workloads; returns the
    drafts accepted."""
    accepted = 0
    for seed in range(seeds):
        plain, _ = _random_schedule(seed, model_dir, None, chains)
        speculative, num_accepted = _random_schedule(seed, model_dir, spec, chains)
        accepted += num_accepted
        for request_id, (want, want_finish) in plain.items():
            got, got_finish = speculative[request_id]
            if "abort" in (want_finish, got_finish):
                n = min(len(want), len(got))
                assert got[:n] == want[:n], (seed, request_id)
            else:
                assert (got, got_finish) == (want, want_finish), (seed, request_id)
    return accepted
