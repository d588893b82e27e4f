"""The text `fp4stack analyze` runs through a model: built-in English prose, so the analysis
needs no download. The models themselves load through fp4stack.models.hf.
"""

from __future__ import annotations

import sys

import torch

# Public-domain English prose (Melville 1851, Austen 1813, Dickens 1859): real text, so the
# activations have the outlier channels and uneven token statistics of a real forward pass.
TEXT = """\
Call me Ishmael. Some years ago--never mind how long precisely--having little or no money in my \
purse, and nothing particular to interest me on shore, I thought I would sail about a little and \
see the watery part of the world. It is a way I have of driving off the spleen and regulating the \
circulation. Whenever I find myself growing grim about the mouth; whenever it is a damp, drizzly \
November in my soul; whenever I find myself involuntarily pausing before coffin warehouses, and \
bringing up the rear of every funeral I meet; and especially whenever my hypos get such an upper \
hand of me, that it requires a strong moral principle to prevent me from deliberately stepping \
into the street, and methodically knocking people's hats off--then, I account it high time to get \
to sea as soon as I can. This is my substitute for pistol and ball. With a philosophical flourish \
Cato throws himself upon his sword; I quietly take to the ship. There is nothing surprising in \
this. If they but knew it, almost all men in their degree, some time or other, cherish very nearly \
the same feelings towards the ocean with me.

It is a truth universally acknowledged, that a single man in possession of a good fortune, must be \
in want of a wife. However little known the feelings or views of such a man may be on his first \
entering a neighbourhood, this truth is so well fixed in the minds of the surrounding families, \
that he is considered the rightful property of some one or other of their daughters. "My dear Mr. \
Bennet," said his lady to him one day, "have you heard that Netherfield Park is let at last?" Mr. \
Bennet replied that he had not. "But it is," returned she; "for Mrs. Long has just been here, and \
she told me all about it." Mr. Bennet made no answer. "Do you not want to know who has taken it?" \
cried his wife impatiently. "You want to tell me, and I have no objection to hearing it." This was \
invitation enough.

It was the best of times, it was the worst of times, it was the age of wisdom, it was the age of \
foolishness, it was the epoch of belief, it was the epoch of incredulity, it was the season of \
Light, it was the season of Darkness, it was the spring of hope, it was the winter of despair, we \
had everything before us, we had nothing before us, we were all going direct to Heaven, we were \
all going direct the other way--in short, the period was so far like the present period, that some \
of its noisiest authorities insisted on its being received, for good or for evil, in the \
superlative degree of comparison only.
"""


def text_batch(tokens: int, tokenizer=None, vocab_size: int | None = None) -> torch.Tensor:
    """input_ids [1, tokens] of TEXT: tokenized when there is a tokenizer, else its UTF-8 bytes
    modulo vocab_size. The text is repeated (with a note on stderr) when it is too short."""
    if tokens < 1:
        raise ValueError(f"tokens must be >= 1, got {tokens}")
    if tokenizer is not None:
        ids = list(tokenizer(TEXT)["input_ids"])
    else:
        if vocab_size is None:
            raise ValueError("byte-level ids need vocab_size")
        ids = [b % vocab_size for b in TEXT.encode()]
    if len(ids) < tokens:
        print(f"note: the built-in text has {len(ids)} tokens; repeating it to reach {tokens}",
              file=sys.stderr)
        ids = ids * (tokens // len(ids) + 1)
    return torch.tensor([ids[:tokens]], dtype=torch.long)
