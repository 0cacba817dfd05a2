"""Continuous batching with chunked prefill, a token budget and recompute preemption."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from fastdeploy.common.config import SchedulerConfig
from fastdeploy.scheduler.block_manager import BlockManager, blocks_needed
from fastdeploy.scheduler.prefix_hash import extend_block_hashes
from fastdeploy.scheduler.sequence import SeqStatus, Sequence

# A waiting sequence whose next uncached blocks another sequence is computing in this step waits a
# step for them only when they hold at least this many tokens: a step of delay is a poor price for
# a short stretch, such as a chat template's first block shared by unrelated prompts.
MIN_SHARED_TOKENS_TO_WAIT = 64


@dataclass
class ScheduledChunk:
    seq: Sequence
    start: int  # first position computed this step
    num_tokens: int
    # A token is sampled once the chunk reaches the end of the known tokens.
    samples: bool
    # Speculative decoding: KV slots reserved after the chunk for up to this many draft tokens.
    num_lookahead: int = 0
    # The positions before `start` came from the prefix cache at admission (the first chunk then).
    after_cache_hit: bool = False


def _chunk(seq: Sequence, num_tokens: int) -> ScheduledChunk:
    start = seq.num_computed_tokens
    return ScheduledChunk(seq, start, num_tokens, start + num_tokens == seq.num_tokens + seq.num_in_flight)


@dataclass
class SchedulerStep:
    chunks: list[ScheduledChunk]  # decodes first, then prefill chunks
    preempted: list[Sequence]
    # Running sequences left out for want of blocks where preemption was not allowed.
    num_blocked: int = 0


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager, num_lookahead_slots: int = 0,
                 num_draft_model_slots: int = 0, prefix_root: bytes = b"", draft_model_cache: bool = False) -> None:
        """`draft_model_cache`: a draft model keeps K/V of its own in the blocks (MTP), which the
        prefix cache then holds too (see `register_computed_blocks` and the admission)."""
        self.config = config
        self.draft_model_cache = draft_model_cache
        self.block_manager = block_manager
        self.prefix_root = prefix_root  # the start of every prefix hash chain (model, dtype)
        self.num_lookahead_slots = num_lookahead_slots  # draft tokens per decode step (speculative decoding)
        # Drafting for the next step reaches past the accepted tokens (a draft model's own K/V,
        # MTP; n-gram lookup on the device reads the token after them): this many more slots
        # after every sampling chunk.
        self.num_draft_model_slots = num_draft_model_slots
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0  # since start, for metrics and tests

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, seq: Sequence) -> None:
        """Release a sequence that stopped or was aborted, wherever it is."""
        if seq.status == SeqStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status == SeqStatus.WAITING:
            self.waiting.remove(seq)
        seq.status = SeqStatus.FINISHED
        self.block_manager.free(seq.block_ids)

    def _preempt(self, seq: Sequence) -> None:
        # Recompute: drop the KV, keep the generated tokens; the sequence re-prefills
        # prompt + output when it is scheduled again, ahead of newer arrivals.
        self.running.remove(seq)
        self.block_manager.free(seq.block_ids)
        seq.num_computed_tokens = 0
        seq.num_registered_blocks = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        seq.status = SeqStatus.WAITING
        self.waiting.appendleft(seq)

    def schedule(self, max_drafts: int | None = None, may_preempt: bool = True) -> SchedulerStep:
        """The next step's chunks. `max_drafts`: at most this many draft tokens per decoding
        sequence in this step (None: the configured number). Without `may_preempt` (a step
        scheduled while the one before it runs: a preempted sequence would lose a token still
        in flight) a running sequence that does not fit waits a step instead."""
        budget = self.config.max_num_batched_tokens
        drafts = self.num_lookahead_slots if max_drafts is None else min(max_drafts, self.num_lookahead_slots)
        reserves = bool(self.num_lookahead_slots or self.num_draft_model_slots)
        block_size = self.block_manager.block_size
        decodes: list[ScheduledChunk] = []
        prefills: list[ScheduledChunk] = []
        preempted: list[Sequence] = []
        scheduled_ids: set[int] = set()
        num_blocked = 0

        for seq in list(self.running):
            if budget == 0:
                break
            if seq.status != SeqStatus.RUNNING:  # preempted earlier in this loop
                continue
            if seq.num_in_flight and seq.tokens_left(self.config.max_model_len) <= 0:
                continue  # its last token is being sampled: nothing after it to compute
            num = min(seq.num_uncomputed_tokens, budget)
            target = seq.num_computed_tokens + num
            # Drafts of the step in flight that may be accepted move this chunk on by as much.
            reach = target + seq.num_in_flight_drafts
            # A decoding sequence needs a new block once every block_size steps: until then its
            # blocks hold `reach` already and the pool is not asked (a busy batch's usual step).
            if len(seq.block_ids) * block_size < reach and not self._grow_or_preempt(seq, reach, may_preempt,
                                                                                    scheduled_ids, preempted):
                num_blocked += seq.status == SeqStatus.RUNNING
                continue
            chunk = _chunk(seq, num)
            if num == 1 and chunk.samples:
                # Without drafts, a chunk whose blocks already hold the draft model's slots past
                # it reserves nothing: checked here, not in a call per sequence (a busy batch's
                # usual step, where this loop is on every step's path).
                if reserves and (drafts or len(seq.block_ids) * block_size < reach + self.num_draft_model_slots):
                    chunk.num_lookahead = self._reserve_lookahead(seq, reach, min(drafts, budget - num))
                    budget -= chunk.num_lookahead
                decodes.append(chunk)
            else:
                if chunk.samples:
                    self._reserve_lookahead(seq, target, 0)
                prefills.append(chunk)
            scheduled_ids.add(seq.seq_id)
            budget -= num

        # New work only when nothing had to be preempted, so admission cannot thrash.
        # Sequences whose grammar still compiles are passed over, not waited for.
        caching = self.block_manager.enable_prefix_caching
        computing = self._uncached_running_blocks() if caching and self.waiting else set()
        for seq in list(self.waiting):
            if preempted or budget == 0 or len(self.running) >= self.config.max_num_seqs:
                break
            if not seq.grammar_ready:
                continue
            cached: list[int] = []
            if caching:
                self._hash_full_blocks(seq)
                # At least the last known token is computed: it gives the logits to sample from.
                # With a draft model's cache, two: the first chunk after a hit is then a prefill
                # chunk, whose first row the draft model takes in from the cached prefix's last
                # hidden state (a one-token chunk would go its decode rows' ways).
                computed = 2 if self.draft_model_cache else 1
                hashes = seq.block_hashes[:max(0, seq.num_tokens - computed) // self.block_manager.block_size]
                cached = self.block_manager.cached_blocks(hashes)
                if _shared_in_flight(hashes, len(cached), computing) * self.block_manager.block_size \
                        >= MIN_SHARED_TOKENS_TO_WAIT:
                    # Another sequence is computing the next stretch of this prefix right now (an
                    # n > 1 group, a burst of one prompt): wait for its blocks instead of redoing them.
                    continue
            # Admit only with room for the whole known sequence plus its next token,
            # so a fresh admission does not immediately force a preemption.
            need = blocks_needed(seq.num_tokens + 1, self.block_manager.block_size) - len(cached)
            if need > self.block_manager.num_free_blocks - self.block_manager.num_reclaimed(cached):
                break
            self.waiting.remove(seq)
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            if caching:
                self.block_manager.record_lookup(len(hashes), len(cached))
                self.block_manager.share(seq.block_ids, cached)
                seq.num_registered_blocks = len(cached)
                seq.num_computed_tokens = len(cached) * self.block_manager.block_size
                computing.update(seq.block_hashes[len(cached):])
            num = min(seq.num_uncomputed_tokens, budget)
            self.block_manager.grow(seq.block_ids, seq.num_computed_tokens + num)
            chunk = _chunk(seq, num)
            chunk.after_cache_hit = bool(cached)
            if chunk.samples:
                self._reserve_lookahead(seq, seq.num_computed_tokens + num, 0)
            (decodes if num == 1 and chunk.samples else prefills).append(chunk)
            budget -= num

        return SchedulerStep(chunks=decodes + prefills, preempted=preempted, num_blocked=num_blocked)

    def _grow_or_preempt(self, seq: Sequence, reach: int, may_preempt: bool, scheduled_ids: set[int],
                         preempted: list[Sequence]) -> bool:
        """Grow `seq`'s blocks to hold `reach` tokens, preempting the latest-admitted sequences not
        scheduled in this step (`seq` itself last) where `may_preempt`; whether `seq` still runs
        with its blocks grown."""
        while may_preempt and not self.block_manager.can_grow(seq.block_ids, reach):
            victim = next((s for s in reversed(self.running) if s.seq_id not in scheduled_ids), None)
            if victim is None:
                break
            self._preempt(victim)
            preempted.append(victim)
            if victim is seq:
                break
        if seq.status != SeqStatus.RUNNING or not self.block_manager.can_grow(seq.block_ids, reach):
            return False
        self.block_manager.grow(seq.block_ids, reach)
        return True

    def _reserve_lookahead(self, seq: Sequence, target: int, budget: int) -> int:
        """Reserve slots after a sampling chunk that holds `target` tokens; return the drafts allowed.

        Drafts never go past max_tokens or the context length and only use free blocks and
        budget: they are an optimisation, never a reason to preempt.
        """
        if not (self.num_lookahead_slots or self.num_draft_model_slots):
            return 0
        # m accepted tokens (drafts + 1) must fit: num_tokens + m <= limit.
        room = seq.tokens_left(self.config.max_model_len) - 1
        lookahead = max(0, min(self.num_lookahead_slots, room, budget))
        extra = max(0, min(self.num_draft_model_slots, self.config.max_model_len - target - lookahead))
        if len(seq.block_ids) * self.block_manager.block_size >= target + lookahead + extra:
            # The blocks already hold every slot (a verify step's usual case, and a step without
            # drafts on all but one in block_size steps): no pool query, no growth.
            return lookahead
        while lookahead + extra and not self.block_manager.can_grow(seq.block_ids, target + lookahead + extra):
            if extra:
                extra -= 1
            else:
                lookahead -= 1
        self.block_manager.grow(seq.block_ids, target + lookahead + extra)
        return lookahead

    def on_step_done(self, step: SchedulerStep) -> None:
        """The step's K/V is written (or queued, ahead of any step that reads it)."""
        for chunk in step.chunks:
            if chunk.seq.status != SeqStatus.RUNNING:  # finished or aborted since it was scheduled
                continue
            # From where the chunk really started: a verify step's accepted drafts, counted once
            # its frame was read, moved a chunk scheduled ahead of that frame on.
            chunk.seq.num_computed_tokens = max(chunk.seq.num_computed_tokens, chunk.start) + chunk.num_tokens
            if self.block_manager.enable_prefix_caching:
                self.register_computed_blocks(chunk.seq)

    def register_computed_blocks(self, seq: Sequence) -> None:
        """Put the sequence's full blocks whose K/V is all computed into the prefix cache. With a
        draft model's cache, only blocks of the prompt: their draft-model K/V and the hidden state
        of their last position are written as the prompt is computed, while output blocks hold
        what steps without drafts kept aside and verify steps' rejected rows."""
        full = min(seq.num_computed_tokens // self.block_manager.block_size, len(seq.block_ids))
        if self.draft_model_cache:
            full = min(full, len(seq.prompt_token_ids) // self.block_manager.block_size)
        if full <= seq.num_registered_blocks:
            return
        self._hash_full_blocks(seq)
        for i in range(seq.num_registered_blocks, min(full, len(seq.block_hashes))):
            self.block_manager.register(seq.block_ids[i], seq.block_hashes[i])
            seq.num_registered_blocks = i + 1

    def _hash_full_blocks(self, seq: Sequence) -> None:
        if len(seq.block_hashes) == seq.num_tokens // self.block_manager.block_size:
            return  # every full block is hashed: skip joining prompt and output again
        extend_block_hashes(seq.block_hashes, seq.all_token_ids, self.block_manager.block_size, self.prefix_root)

    def _uncached_running_blocks(self) -> set[bytes]:
        """Prefix hashes of running sequences' full blocks that are not in the cache yet."""
        pending: set[bytes] = set()
        for seq in self.running:
            pending.update(seq.block_hashes[seq.num_registered_blocks:])
        return pending


def _shared_in_flight(hashes: list[bytes], start: int, computing: set[bytes]) -> int:
    """How many of `hashes`, from `start` on, are being computed by a running sequence."""
    n = 0
    while start + n < len(hashes) and hashes[start + n] in computing:
        n += 1
    return n
