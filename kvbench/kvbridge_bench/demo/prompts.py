"""The demo's prompts: the agent trace's segments made of real text.

The trace generator (kvbridge_bench.sim.trace) describes each request as segments
shared by reference: a system prompt, the user's message, each earlier
answer and tool output.  With a real model each generated segment
``GenSegment(seed, length)`` becomes ``length`` tokens of English text (an
agent's instructions, tool documentation, code, logs), taken from a fixed
corpus at an offset given by the seed, so two requests share exactly the
tokens the trace says they share.  Each prompt ends with the chat template's
assistant header.  With the random model the segments expand to the trace's
own pseudo-random token ids.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np

from ..sim.trace import GenSegment, LiteralSegment, TraceRequest, expand_gen

__all__ = ["CORPUS", "PromptBuilder"]


class _Tokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...


CORPUS = """\
You are a coding agent working in a large Python repository. You can read files, search the \
tree, run the test suite and edit code. Before you change anything, read the code around it \
and the tests that cover it. Keep every change small and explain why it is needed. When a test \
fails, read the whole error message, find the first line that belongs to the project, and fix \
the cause, not the symptom. Never delete a test to make the suite pass. If you are not sure \
what a function does, read its callers. Prefer the standard library; add a dependency only \
when the task needs it and say so. Write commit messages that say what is true of the code \
after the change.

Tools. read_file(path, start, end) returns the lines of a file. search(pattern, path) returns \
the matching lines with their file names and line numbers. run(command) runs a shell command \
in the repository and returns its exit status, its standard output and its standard error. \
edit(path, old, new) replaces one exact occurrence of old with new and fails if old appears \
twice or not at all. list_dir(path) returns the entries of a directory. Each tool call costs \
time: batch what you need, and do not read the same file twice.

The repository holds a transfer library for key-value caches. The prefill service computes the \
cache of a prompt and sends it to a decode service in another datacenter, over several TCP \
connections at once. A relay decode next to the prefill starts streaming tokens to the user \
while the cache is still crossing the wide-area network, then hands the request over by \
sending only the token ids it generated. The decode side keeps a radix tree of the prefixes \
it already holds, so that only the missing suffix crosses the network.

def send_chunks(conn, chunks, deadline):
    for index, chunk in enumerate(chunks):
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError(f"chunk {index} not sent before the deadline")
        conn.write(chunk.header())
        conn.write(chunk.payload)
    return len(chunks)

class LeaseTable:
    def __init__(self, capacity):
        self.capacity = capacity
        self.leases = {}

    def grant(self, request_id, pages, now, seconds):
        if len(self.leases) >= self.capacity:
            raise ResourceWarning("no room for another lease")
        lease = Lease(request_id, tuple(pages), now + seconds)
        self.leases[request_id] = lease
        return lease

    def expire(self, now):
        gone = [r for r, lease in self.leases.items() if lease.deadline <= now]
        for r in gone:
            del self.leases[r]
        return gone

2026-11-30 14:02:11 INFO receiver: peer prefill-0 authenticated (psk), 4 streams
2026-11-30 14:02:11 INFO receiver: transfer r-1182 open, 2621440 bytes in 10 chunks
2026-11-30 14:02:12 WARNING sender: connection 3 lost (reset by peer), resuming on 3 streams
2026-11-30 14:02:12 INFO sender: transfer r-1182 resumed, 7 of 10 chunks acknowledged
2026-11-30 14:02:13 INFO receiver: transfer r-1182 complete in 1.84 s (1.42 MB/s)
2026-11-30 14:02:13 ERROR decode: request r-1190 refused: no space for 512 pages

$ python -m pytest -q tests/test_lease.py
..F.
FAILED tests/test_lease.py::test_expire_keeps_live_leases - AssertionError: assert 2 == 1
1 failed, 3 passed in 0.41s

The test expects that a lease whose deadline equals the current time has expired, but the \
comparison in expire uses less-or-equal, so the lease granted at time zero for zero seconds is \
gone while the other one stays. The fix is in the test, which builds the second lease with a \
deadline in the past by mistake. Reading the history of the file shows that the deadline \
argument was renamed from seconds to duration in a refactoring two weeks ago, and the test was \
not updated.

Configuration. The service reads its settings from a TOML file. [network] sets the listen \
address, the number of streams per peer and the chunk size; [security] names the pre-shared \
keys per peer identity and the identities allowed to connect; [limits] bounds the bytes in \
flight per peer, the connections per identity and the transfers open per connection. Unknown \
keys are an error, so that a typo does not silently keep a default. Every limit has a default \
that suits a line of ten gigabits per second with a round trip of forty milliseconds.

Question from the user: the nightly benchmark shows the transfer rate falling from 9.1 to 6.4 \
gigabits per second after last week's merge. Find which change caused it, explain why, and \
propose a fix with a measurement that shows it works. The benchmark runs on two machines in \
different datacenters; the numbers in the report are medians over five runs.

Summary of the work so far: the slowdown appears only with compression enabled. The merge \
moved the checksum of each chunk from the sender's worker threads onto the event loop, so the \
loop now spends a third of its time hashing while the sockets wait for data. Moving the \
checksum back into the thread pool restores 9.0 gigabits per second in a local test with \
emulated latency; the remaining gap is within the variation between runs.
"""


class PromptBuilder:
    """Token ids of a trace request (see the module text)."""

    def __init__(self, tokenizer: _Tokenizer | None, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.tokenizer = tokenizer
        if tokenizer is not None:
            self.corpus = np.asarray(tokenizer.encode(CORPUS), dtype=np.int64)
            self.suffix = tuple(tokenizer.encode("<|im_end|>\n<|im_start|>assistant\n"))
        else:
            self.corpus = np.zeros(0, dtype=np.int64)
            self.suffix = ()

    def segment(self, seed: int, length: int) -> Sequence[int]:
        if self.tokenizer is None:
            return [int(t) for t in expand_gen(seed, length, self.vocab_size)]
        n = self.corpus.size
        start = seed % n
        idx = (start + np.arange(length)) % n
        return [int(t) for t in self.corpus[idx]]

    def tokens(self, req: TraceRequest) -> list[int]:
        out: list[int] = []
        for s in req.segments:
            if isinstance(s, GenSegment):
                out.extend(self.segment(s.seed, s.length))
            elif isinstance(s, LiteralSegment):
                out.extend(s.tokens)
        out.extend(self.suffix)
        return out
