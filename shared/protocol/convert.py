"""Between wire structs and engine types."""

from __future__ import annotations

import msgspec

from shared.model.sampling import SamplingParams
from shared.protocol.messages import SamplingMsg


def to_params(msg: SamplingMsg, *, num_resumed: int = 0) -> SamplingParams:
    """Engine parameters for a request that already streamed `num_resumed` tokens (validated: a
    bad value raises ValueError naming it)."""
    fields = msgspec.structs.asdict(msg)
    fields["max_tokens"] = msg.max_tokens - num_resumed
    fields["min_tokens"] = max(0, msg.min_tokens - num_resumed)
    return SamplingParams(**fields)


def to_msg(params: SamplingParams) -> SamplingMsg:
    return SamplingMsg(max_tokens=params.max_tokens, temperature=params.temperature, top_p=params.top_p,
                       top_k=params.top_k, seed=params.seed, stop=list(params.stop),
                       stop_token_ids=list(params.stop_token_ids), ignore_eos=params.ignore_eos,
                       min_tokens=params.min_tokens, skip_special_tokens=params.skip_special_tokens)
