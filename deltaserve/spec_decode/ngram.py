"""`NgramProposer`: prompt lookup decoding (vLLM's `ngram` method), no model.

The proposal for a request is what followed an earlier occurrence of its context's last n tokens (context =
prompt + output so far): the longest n in [prompt_lookup_min, prompt_lookup_max] that occurs earlier wins, and of
its occurrences the earliest one, as in vLLM's `_find_longest_matched_ngram_and_propose_tokens` (so acceptance
numbers compare with vLLM's). The earliest occurrence also leaves the most tokens after it: in a repeating
context the latest occurrence overlaps the suffix and has only one period of tokens left to propose.

Cost: the search is vectorised over the whole context (numpy: one comparison of every position with the last
token, then up to max_n - 1 narrowing comparisons on the candidates), so no window cap is needed: about 12 µs
for a random 32k-token context on one CPU core. Converting a token list to an array is the larger cost (about 30
µs per 1k tokens), so each request's prompt array is kept while it keeps decoding; only its output tokens are
converted each step.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from deltaserve.request import Request
from deltaserve.spec_decode.proposer import Proposal


class NgramProposer:
    """Proposes, per request, up to `num_speculative_tokens` tokens found by n-gram lookup in its own context.

    Proposals are deterministic (`Proposal.probs` is None), so verification samples the target as plain decoding
    would. Holds no device memory.
    """

    def __init__(self, num_speculative_tokens: int, prompt_lookup_min: int, prompt_lookup_max: int) -> None:
        if not 1 <= prompt_lookup_min <= prompt_lookup_max:
            raise ValueError(f"need 1 <= prompt_lookup_min ({prompt_lookup_min}) <= prompt_lookup_max "
                             f"({prompt_lookup_max})")
        if num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {num_speculative_tokens}")
        self.k, self.min_n, self.max_n = num_speculative_tokens, prompt_lookup_min, prompt_lookup_max
        self._prompts: dict[str, np.ndarray] = {}
        """Prompt arrays of the requests of the last `propose` call (kept only while they keep decoding)."""

    @property
    def num_speculative_tokens(self) -> int:
        return self.k

    @property
    def memory_bytes(self) -> int:
        return 0

    def propose(self, requests: Sequence[Request]) -> dict[str, Proposal]:
        """A proposal for every request whose context has an earlier occurrence of one of its last n-grams."""
        prompts: dict[str, np.ndarray] = {}
        proposals: dict[str, Proposal] = {}
        for request in requests:
            prompt = self._prompts.get(request.request_id)
            if prompt is None:
                prompt = np.asarray(request.prompt_token_ids, dtype=np.int64)
            prompts[request.request_id] = prompt
            context = np.concatenate((prompt, np.asarray(request.output_token_ids, dtype=np.int64)))
            tokens = propose_ngram(context, self.min_n, self.max_n, self.k)
            if tokens:
                proposals[request.request_id] = Proposal(tokens)
        self._prompts = prompts  # requests that stopped decoding (finished, preempted) drop out here
        return proposals

    def forget(self, request_id: str) -> None:
        self._prompts.pop(request_id, None)


def propose_ngram(context: np.ndarray, min_n: int, max_n: int, k: int) -> list[int]:
    """Up to `k` tokens that followed the earliest earlier occurrence of the longest suffix n-gram of `context`
    (min_n <= n <= max_n); [] if none occurs. An occurrence must end before the last token; it may overlap the
    suffix (a run of one repeated token matches itself shifted by one), and the proposal may run into the suffix.
    """
    length = len(context)
    if length < min_n + 1:
        return []
    # ends: candidate end positions e (the occurrence is context[e - n + 1 : e + 1]), e < length - 1.
    ends = np.flatnonzero(context[: length - 1] == context[length - 1])
    if not ends.size:
        return []
    matched = 1
    while matched < max_n:
        room = ends[ends >= matched]  # occurrences with a token before them, to match one more suffix token
        extended = room[context[room - matched] == context[length - 1 - matched]]
        if not extended.size:
            break
        ends, matched = extended, matched + 1
    if matched < min_n:
        return []
    start = int(ends[0]) + 1  # the earliest occurrence of the longest n-gram
    return context[start : start + k].tolist()
