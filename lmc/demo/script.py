"""What the demo asks: multi-round chats over one long shared system prompt, then questions
about one document, as a :class:`Script`; and how a script's turns become prompt ids.

Two scripts. On a real model (a checkpoint with a chat template) the texts are fixed and
English: the system prompt is the notes of a bicycle workshop (``bundled_text("workshop")``,
~690 tokens with the template), the document a harbour town's history (``"harbour"``), and
every question was chosen because SmolLM2-135M answers it correctly from exact KV (a 135 M
model confuses two-part questions: each question asks one fact). On the random-weight demo
model the texts are pseudo-English generated to token sizes (:class:`Workload`): the answers
mean nothing, only the token ids compared across passes do.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

_WORDS = ["cache", "key", "value", "token", "prompt", "model", "layer", "block", "engine", "memory", "disk", "server", "request", "reply", "query", "answer", "system", "user", "agent", "document", "chunk", "prefix", "store", "load", "save", "copy", "river", "mountain", "forest", "ocean", "city", "village", "garden", "window", "door", "table", "chair", "book", "letter", "morning", "evening", "night", "winter", "summer", "spring", "rain", "snow", "wind", "storm", "cloud", "light", "red", "green", "blue", "quiet", "small", "large", "old", "new", "fast", "slow", "bright", "dark", "warm", "cold", "teacher", "student", "doctor", "writer", "run", "walk", "read", "write", "build", "open", "close", "carry", "find", "keep", "send", "take", "give", "make", "see", "know", "think", "want", "need", "help", "watch", "call", "ask", "tell", "show", "is", "was", "are", "has", "will", "can", "should", "and", "or", "but", "so", "because", "while", "when", "where", "after", "before", "in", "on", "at", "by", "for", "with", "from", "over", "under", "always", "never", "often", "again", "already", "still", "just", "only", "first", "last", "next", "early", "late"]  # noqa: E501

REAL_SYSTEM = ("You are the assistant of the bicycle workshop on Mill Lane. Answer each "
               "question in one short sentence, using only these notes about the workshop."
               "\n\n")
# [chat][round]; each round's prompt carries the chat so far, the model's answers included
REAL_CHATS = [["When did the workshop on Mill Lane open?",
               "How many bicycles does it repair a week?"],
              ["What did the sign above the door say?", "When did Agnes Porter retire?"]]
REAL_QUESTIONS = ["When did the railway line close?", "What colour is the lighthouse?"]
REAL_MAX_TOKENS = 17  # the longest answer, "... in the spring of 1987.", and its end of turn


@dataclass(frozen=True)
class Script:
    """The requests of one pass: ``chats[c][r]`` is chat ``c``'s user turn in round ``r``
    (rounds run across chats: round 1 of every chat, then round 2...), then each of
    ``questions`` asked about ``document``. ``stop_at_eos``: answers end at the model's
    end-of-turn token (a real model), else run to ``max_tokens``."""

    system: str
    chats: list[list[str]]
    document: str
    questions: list[str]
    max_tokens: int
    stop_at_eos: bool
    real_text: bool  # the answers are worth printing
    document_name: str = "document"

    @property
    def num_requests(self) -> int:
        return sum(len(c) for c in self.chats) + len(self.questions)

    @property
    def rounds(self) -> int:
        return max((len(c) for c in self.chats), default=0)


def real_script(short: bool = False) -> Script:
    """The real-model script (see the module doc); ``short``: one chat of two rounds and one
    question (what the tests run: about a minute on two busy cores)."""
    from lmc.models.texts import bundled_text

    chats = REAL_CHATS[:1] if short else REAL_CHATS
    questions = REAL_QUESTIONS[:1] if short else REAL_QUESTIONS
    return Script(REAL_SYSTEM + bundled_text("workshop"), [list(c) for c in chats],
                  bundled_text("harbour"), list(questions), REAL_MAX_TOKENS, True, True,
                  "the harbour town's history")


# ------------------------------------------------------------- random-weight model
@dataclass(frozen=True)
class Workload:
    """The random-text script's sizes in tokens (approximate: text is generated until it
    encodes to at least this)."""

    system_tokens: int = 2000
    sessions: int = 3
    rounds: int = 3
    turn_tokens: int = 60
    doc_tokens: int = 3500
    questions: int = 3
    max_tokens: int = 16
    seed: int = 0

    @classmethod
    def quick(cls) -> Workload:
        return cls(system_tokens=600, sessions=2, rounds=2, turn_tokens=30, doc_tokens=900,
                   questions=2, max_tokens=4)

    @property
    def num_requests(self) -> int:
        return self.sessions * self.rounds + self.questions


def pseudo_text(rng: random.Random, encode: Callable[[str], list[int]], tokens: int) -> str:
    """Pseudo-English sentences until the text encodes to ``tokens`` tokens or more."""
    parts: list[str] = []
    while True:
        words = [rng.choice(_WORDS) for _ in range(rng.randint(6, 16))]
        parts.append(" ".join(words).capitalize() + rng.choice(".?!."))
        if len(parts) % 8 == 0 and len(encode(" ".join(parts))) >= tokens:
            return " ".join(parts)


def random_script(w: Workload, encode: Callable[[str], list[int]]) -> Script:
    rng = random.Random(w.seed)
    system = pseudo_text(rng, encode, w.system_tokens)
    chats = [[pseudo_text(rng, encode, w.turn_tokens) for _ in range(w.rounds)]
             for _ in range(w.sessions)]
    document = pseudo_text(rng, encode, w.doc_tokens)
    questions = [pseudo_text(rng, encode, w.turn_tokens // 2) for _ in range(w.questions)]
    return Script(system, chats, document, questions, w.max_tokens, False, False)


# --------------------------------------------------------------------------- prompts
class Prompts(Protocol):
    """How a script's turns become prompt ids for one checkpoint."""

    def chat(self, system: str, turns: list[str], answers: list[str]) -> list[int]: ...

    def question(self, document: str, question: str) -> list[int]: ...


class ChatPrompts:
    """Through the checkpoint's own chat template (``LLM.encode_chat``)."""

    def __init__(self, llm: Any) -> None:
        self.llm = llm

    def chat(self, system: str, turns: list[str], answers: list[str]) -> list[int]:
        messages = [{"role": "system", "content": system}]
        for i, turn in enumerate(turns):
            messages.append({"role": "user", "content": turn})
            if i < len(answers):
                messages.append({"role": "assistant", "content": answers[i]})
        return list(self.llm.encode_chat(messages))

    def question(self, document: str, question: str) -> list[int]:
        content = f"{document}\n\nAnswer in one short sentence: {question}"
        return list(self.llm.encode_chat([{"role": "user", "content": content}]))


class PlainPrompts:
    """Plain text for a checkpoint without a chat template: ``User:``/``Assistant:`` lines."""

    def __init__(self, llm: Any) -> None:
        self.llm = llm

    def chat(self, system: str, turns: list[str], answers: list[str]) -> list[int]:
        text = system
        for i, turn in enumerate(turns):
            text += f"\nUser: {turn}\nAssistant:"
            if i < len(answers):
                text += " " + answers[i].strip()
        return list(self.llm.encode(text))

    def question(self, document: str, question: str) -> list[int]:
        return list(self.llm.encode(f"{document}\n\nQuestion: {question}\nAnswer:"))


def prompts_for(llm: Any) -> Prompts:
    """Chat prompts where the checkpoint has a template, plain text otherwise."""
    return ChatPrompts(llm) if getattr(llm, "chat_template", None) is not None \
        else PlainPrompts(llm)
