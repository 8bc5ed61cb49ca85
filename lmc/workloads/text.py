"""Seeded English-like text: varied sentences from a small grammar and word lists.

Why not one repeated word or random tokens: a cache benchmark on degenerate text can
flatter a tokenizer (one token for a long run), hides how real prompts chunk, and makes
documents identical where a real corpus has distinct ones. Sentences here vary in length,
structure, vocabulary and punctuation, so two documents made with different seeds share
no long run of words, while the same seed always gives the same text.
"""

from __future__ import annotations

import random


def _split(text: str) -> list[str]:
    return text.split()


_NOUNS = _split("""
river mountain forest ocean city village garden window door table chair book letter harbor
valley bridge road station market library museum school hospital factory kitchen bakery
engine server cache request answer question record ledger report signal network circuit
teacher student doctor farmer writer painter singer driver builder sailor keeper merchant
captain engineer gardener baker nurse pilot scholar clerk guard neighbor stranger traveler
storm cloud river lantern compass journal map ticket coin basket rope ladder candle mirror
orchard meadow island canyon glacier desert harbor lighthouse tower castle cottage barn
theory method model system pattern process feature result problem solution measure budget
""")
_NAMES = _split("""
Alice Bruno Chen Dalia Emil Farah Goran Hana Ivo Jun Kiran Lena Mateo Nadia Omar Priya
Quinn Rosa Sami Tomas Uma Viktor Wen Yara Zeno Ada Boris Clara Diego Elif
""")
_VERBS = _split("""
carried found kept sent took gave made saw knew wanted needed watched called asked told
showed built opened closed painted wrote read measured counted repaired studied visited
crossed followed described explained noticed remembered forgot borrowed returned checked
moved lifted traded planted collected compared recorded answered delivered prepared
""")
_INTRANSITIVE = _split("""
waited laughed slept arrived left returned wandered listened worked paused hesitated
smiled agreed disappeared stayed rested travelled vanished improved failed succeeded
""")
_ADJECTIVES = _split("""
quiet loud small large old new fast slow bright dark warm cold narrow wide heavy light
careful curious patient tired eager gentle strange familiar distant hidden broken golden
silver wooden ancient modern simple complex crowded empty early late honest clever
""")
_ADVERBS = _split("""
slowly quickly carefully quietly suddenly finally often rarely always never again already
eventually gladly barely nearly openly gently firmly calmly proudly sadly
""")
_PREPOSITIONS = _split("in on near behind beside under over across through along past beyond")
_TIME_PHRASES = ["that morning", "at noon", "before dawn", "after supper", "in the spring",
                 "during the storm", "last winter", "on the third day", "by evening",
                 "since the harvest", "until the fog lifted", "a year later"]
_CONNECTIVES = ["and", "but", "so", "because", "while", "although", "until", "since"]
_DETERMINERS = ["the", "a", "this", "that", "every", "one", "her", "his", "their", "our"]


class TextGen:
    """Deterministic sentence and paragraph maker; ``TextGen(seed)`` twice gives the same
    text, different seeds give different text."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)

    # -- pieces
    def _np(self) -> str:
        r = self.rng
        if r.random() < 0.15:
            return r.choice(_NAMES)
        words = [r.choice(_DETERMINERS)]
        if r.random() < 0.5:
            words.append(r.choice(_ADJECTIVES))
        words.append(r.choice(_NOUNS))
        if r.random() < 0.2:
            words += [r.choice(_PREPOSITIONS), "the", r.choice(_NOUNS)]
        return " ".join(words)

    def _clause(self) -> str:
        r = self.rng
        subject = self._np()
        if r.random() < 0.3:
            parts = [subject, r.choice(_INTRANSITIVE)]
        else:
            parts = [subject, r.choice(_VERBS), self._np()]
        if r.random() < 0.3:
            parts.insert(1, r.choice(_ADVERBS))
        if r.random() < 0.35:
            parts += [r.choice(_PREPOSITIONS), self._np()]
        if r.random() < 0.15:
            parts.append(f"for {r.randint(2, 90)} {r.choice(['days', 'hours', 'years', 'miles'])}")
        return " ".join(parts)

    def sentence(self) -> str:
        r = self.rng
        text = self._clause()
        if r.random() < 0.35:
            text += f" {r.choice(_CONNECTIVES)} {self._clause()}"
        if r.random() < 0.25:
            text = f"{r.choice(_TIME_PHRASES)}, {text}"
        end = r.choices([".", "?", "!"], weights=[8, 1, 1])[0]
        return text[0].upper() + text[1:] + end

    def words(self, n: int) -> str:
        """Whole sentences until the text has at least ``n`` words (about ``n`` to
        ``1.3 n`` tokens with an English BPE)."""
        out: list[str] = []
        count = 0
        while count < n:
            s = self.sentence()
            out.append(s)
            count += s.count(" ") + 1
        return " ".join(out)

    def paragraphs(self, n_words: int, per_paragraph: int = 80) -> str:
        """About ``n_words`` words in paragraphs separated by blank lines (a document)."""
        paras: list[str] = []
        left = n_words
        while left > 0:
            size = min(left, max(20, int(self.rng.gauss(per_paragraph, per_paragraph / 4))))
            para = self.words(size)
            paras.append(para)
            left -= para.count(" ") + 1
        return "\n\n".join(paras)
