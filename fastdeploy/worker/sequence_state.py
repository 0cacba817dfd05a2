"""What the worker keeps per sequence between steps."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from fastdeploy.common.sampling_params import SamplingParams


@dataclass
class WorkerSequence:
    """Device-side state the worker keeps for a sequence between steps."""

    prompt_token_ids: list[int]
    params: SamplingParams
    return_sampling_mask: bool
    generator: torch.Generator | None
    sampling_mask_bitmap: bool = False
    output_token_ids: list[int] = field(default_factory=list)
    pending_drafts: list[int] = field(default_factory=list)  # MTP: drafted after the last step
    # MTP: pairs before the next row that steps without drafts kept aside instead of taking in
    # (`fastdeploy/spec_decode/mtp_gaps.py`); the next pass over the sequence takes them in first.
    mtp_gap: int = 0

    def token_range(self, start: int, end: int) -> list[int]:
        """Tokens start..end-1 of prompt + output, without building the whole sequence."""
        prompt, output = self.prompt_token_ids, self.output_token_ids
        n = len(prompt)
        if start >= n:
            return output[start - n:end - n]
        return prompt[start:end] + output[:max(0, end - n)]
