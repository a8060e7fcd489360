"""The output budget: a byte bound on the generated output that live requests hold in memory.

Until its terminal row commits, a request keeps its whole output on the event loop: the stream's
resume buffer (`server.serving.streams`), the job's per-sample accumulation (`server.serving.jobs`,
sharing the same logprob objects) and, at the end, the stored form. All of it grows with every
token, and with logprobs by `1 + top_logprobs` entries per token, so one client could otherwise
make the server hold gigabytes (issue 13, bug 6: 40 generates of 2,000 tokens with 20 top
logprobs). Frames cannot bound that: the bytes are what a resume or the ledger needs.

So admission reserves each request's worst case — `max_tokens × n` tokens at the size the streams
count for them (`streams.delta_bytes_bound`) — against two bounds, one per client and one for the
whole server, and refuses with 429 `output_budget_exceeded` (naming the fields that size it) when
either would be passed (400 when the request alone is larger than a bound). The reservation
is released when the terminal row has committed; from then on the stream's retention is
bounded by the registry's own byte budget (`StreamRegistry`).
"""
from __future__ import annotations

from typing import Optional

from server.engine.sampling_params import SamplingParams
from server.serving.errors import InvalidRequest, Overloaded
from server.serving.streams import delta_bytes_bound


def worst_case_bytes(params: SamplingParams) -> int:
    """The most output bytes one request can hold: every token in its own delta."""
    tokens = (params.max_tokens or 0) * max(1, params.n)
    return tokens * delta_bytes_bound(1, params.logprobs)


class OutputBudget:
    """Reservations of output bytes per client and in total (event loop only)."""

    def __init__(self, max_bytes: int, max_client_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.max_client_bytes = max_client_bytes
        self.reserved = 0
        self._by_client: dict[str, int] = {}

    def reserve(self, client: str, nbytes: int, params: SamplingParams) -> None:
        """Claim `nbytes` for `client`, or refuse: 400 when the request alone is over a bound (a
        retry cannot help), 429 when the live output of earlier requests leaves no room."""
        mine = self._by_client.get(client, 0)
        sized = f"max_tokens={params.max_tokens}, n={params.n}"
        if params.logprobs is not None:
            sized += f", top_logprobs={params.logprobs}"
        param = "top_logprobs" if params.logprobs else "max_tokens"
        head = f"{param}: this request's output can take up to {nbytes} bytes in memory ({sized})"
        alone = min(self.max_bytes, self.max_client_bytes)
        if nbytes > alone:
            raise InvalidRequest(f"{head}, more than the limit of {alone} bytes; lower max_tokens, n or "
                                 "top_logprobs", param=param, code="output_budget_exceeded")
        why: Optional[str] = None
        if mine + nbytes > self.max_client_bytes:
            why = f"this client's live requests already hold {mine} of its {self.max_client_bytes} bytes"
        elif self.reserved + nbytes > self.max_bytes:
            why = f"live requests already hold {self.reserved} of the server's {self.max_bytes} bytes"
        if why is not None:
            raise Overloaded(f"{head}, and {why}; retry when earlier requests have finished, or lower "
                             "max_tokens or top_logprobs", param=param, code="output_budget_exceeded",
                             retry_after_s=1.0)
        self._by_client[client] = mine + nbytes
        self.reserved += nbytes

    def release(self, client: str, nbytes: int) -> None:
        left = self._by_client.get(client, 0) - nbytes
        if left > 0:
            self._by_client[client] = left
        else:
            self._by_client.pop(client, None)
        self.reserved = max(0, self.reserved - nbytes)

    def __len__(self) -> int:
        """How many clients hold a reservation (it must not outlive their requests)."""
        return len(self._by_client)
