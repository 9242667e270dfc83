"""Stop-word matching in time linear in the generated text: an Aho-Corasick automaton.

``StopMatcher`` is built once per request from its stop words (time and memory linear in
their total length) and fed each decoded piece once. Feeding costs amortised O(1) per
character whatever the number and length of the stop words, and tells both things the
engines need after each piece: the stop word that starts earliest among those completed
(llama-server's rule: the earliest occurrence in the text wins), and how many characters
at the end of the text could still begin a stop word (what must be held back).

Owned by one ``Seq`` and used only on its engine's thread; no locks.
"""

from __future__ import annotations

from collections import deque


class StopMatcher:
    """The automaton over ``words`` and where it stands in the text fed so far."""

    def __init__(self, words: tuple[str, ...]) -> None:
        self._goto: list[dict[str, int]] = [{}]
        self._depth = [0]
        ends: list[str | None] = [None]  # the word spelled by a node, if it is one
        for word in words:
            node = 0
            for ch in word:
                nxt = self._goto[node].get(ch)
                if nxt is None:
                    nxt = len(self._goto)
                    self._goto.append({})
                    self._depth.append(self._depth[node] + 1)
                    ends.append(None)
                    self._goto[node][ch] = nxt
                node = nxt
            if word:
                ends[node] = word
        n = len(self._goto)
        self._fail = [0] * n
        # the longest word that is a suffix of a node's string (the earliest-starting match)
        self._longest: list[str | None] = list(ends)
        queue = deque(self._goto[0].values())
        while queue:
            node = queue.popleft()
            for ch, child in self._goto[node].items():
                f = self._fail[node]
                while f and ch not in self._goto[f]:
                    f = self._fail[f]
                target = self._goto[f].get(ch, 0)
                self._fail[child] = target if target != child else 0
                self._longest[child] = ends[child] or self._longest[self._fail[child]]
                queue.append(child)
        self.state = 0

    @property
    def partial(self) -> int:
        """Characters at the end of the text fed so far that could begin a stop word."""
        return self._depth[self.state]

    def feed(self, text: str) -> tuple[int, str] | None:
        """Advance over ``text``; the completed stop word that starts earliest, as (its start
        relative to ``text``, negative when it began in earlier text; the word), or None."""
        goto, fail, longest = self._goto, self._fail, self._longest
        state = self.state
        best: tuple[int, str] | None = None
        for i, ch in enumerate(text):
            while state and ch not in goto[state]:
                state = fail[state]
            state = goto[state].get(ch, 0)
            word = longest[state]
            if word is not None:
                start = i + 1 - len(word)
                if best is None or start < best[0]:
                    best = (start, word)
        self.state = state
        return best
