"""How validation hands its lines to the screener: a chunk at a time, so that one search
covers many lines."""

from __future__ import annotations

from jobs.formats.wire import RequestLine
from jobs.policy.screener import Screener
from jobs.policy.violation import ViolationSink

# A chunk ends when its lines' prompt-size estimates, each line counting LINE_TOKENS more,
# reach CHUNK_TOKENS (one sum per line). So a chunk is at most CHUNK_TOKENS / LINE_TOKENS
# lines (enough that the calls into RE2 and the chunk's bookkeeping cost little per line,
# few enough that the lines are still in the CPU's caches when their texts are gathered:
# bench/RESULTS.md, section 8) and holds about CHUNK_TOKENS tokens of text at most.
CHUNK_TOKENS = 65_536
LINE_TOKENS = 1_024


class ScreeningChunker:
    """Collects the lines of a batch (`add`) and has `screener` screen them a chunk at a
    time; `finish` screens the rest and flushes. Violations go to `sink`."""

    def __init__(self, screener: Screener, sink: ViolationSink) -> None:
        self.screener = screener
        self.sink = sink
        # The lines waiting: (line number, custom_id, tokens, text), their requests too
        # when the screener counts tokens (`needs_requests`, asked at the first line), and
        # the chunk's size as CHUNK_TOKENS counts it.
        self.lines: list[tuple[int, str, int, str]] = []
        self.requests: list[RequestLine] = []
        self.size = 0
        self.keep_requests: bool | None = None

    def add(self, number: int, request: RequestLine, tokens: int, text: str) -> None:
        """Line `number`, its request, its prompt-size estimate and its prompt text."""
        if self.keep_requests is None:
            self.keep_requests = self.screener.needs_requests(request.model)
        self.lines.append((number, request.custom_id, tokens, text))
        if self.keep_requests:
            self.requests.append(request)
        self.size += tokens + LINE_TOKENS
        if self.size >= CHUNK_TOKENS:
            self.screener.screen(self.lines, self.sink, self.requests)
            self.lines, self.requests, self.size = [], [], 0

    def finish(self) -> None:
        """Screen the lines left, and those waiting for a moderation rule."""
        self.screener.screen(self.lines, self.sink, self.requests)
        self.screener.flush(self.sink)
