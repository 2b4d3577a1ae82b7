"""Token batches for BERT masked-LM pretraining: synthetic (the default) or from a local text file.

Batch ``k`` is drawn from a generator seeded by (seed, k) alone, so it is the same whatever ran
before it: a run resumed from a checkpoint sees exactly the batches of an uninterrupted run.
Batches are dicts of host tensors ``{"input_ids", "labels"}``, both int64 [batch, seq_len];
``labels`` is -100 except at the masked positions (the MLM loss is a mean over those).
"""

from __future__ import annotations

from pathlib import Path

import torch

SPECIAL_TOKENS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
PAD, UNK, CLS, SEP, MASK = range(len(SPECIAL_TOKENS))  # special ids come first in every vocabulary
FIRST_WORD = len(SPECIAL_TOKENS)
IGNORE = -100             # label of a position the loss skips (transformers' convention)
MASK_PROB = 0.15          # BERT: 15% of positions become targets; of those
MASK_SPLIT = (0.8, 0.1)   # 80% -> [MASK], 10% -> a random word, the remaining 10% unchanged
BERT_VOCAB_SIZE = 30522


def _generator(seed: int, step: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed * 1_000_003 + step)


def mask_tokens(tokens: torch.Tensor, vocab_size: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """BERT's MLM corruption of a [batch, seq] id tensor; returns (input_ids, labels).

    Special tokens are never targets. Every row gets at least one target, so the token-mean loss
    of any micro-batch is defined.
    """
    special = tokens < FIRST_WORD
    chosen = (torch.rand(tokens.shape, generator=generator) < MASK_PROB) & ~special
    empty = ~chosen.any(dim=1)
    if empty.any():
        scores = torch.rand(tokens.shape, generator=generator).masked_fill(special, -1.0)
        rows = empty.nonzero().squeeze(1)
        chosen[rows, scores[rows].argmax(dim=1)] = True
    labels = tokens.masked_fill(~chosen, IGNORE)
    action = torch.rand(tokens.shape, generator=generator)
    inputs = tokens.masked_fill(chosen & (action < MASK_SPLIT[0]), MASK)
    randomised = chosen & (action >= MASK_SPLIT[0]) & (action < MASK_SPLIT[0] + MASK_SPLIT[1])
    words = torch.randint(FIRST_WORD, vocab_size, tokens.shape, generator=generator)
    return torch.where(randomised, words, inputs), labels


def _frame(words: torch.Tensor) -> torch.Tensor:
    """[CLS] words [SEP] per row."""
    rows = words.shape[0]
    return torch.cat([torch.full((rows, 1), CLS), words, torch.full((rows, 1), SEP)], dim=1)


class SyntheticTokens:
    """Words drawn from a Zipf distribution over the vocabulary: a unigram model the network can
    learn, so the loss visibly falls (from about ln(vocab) towards the distribution's entropy)."""

    def __init__(self, batch_size: int, seq_len: int, seed: int, vocab_size: int = BERT_VOCAB_SIZE):
        self.batch_size, self.seq_len, self.seed, self.vocab_size = batch_size, seq_len, seed, vocab_size
        self.weights = 1.0 / torch.arange(1, vocab_size - FIRST_WORD + 1, dtype=torch.float64)

    def batch(self, step: int) -> dict[str, torch.Tensor]:
        generator = _generator(self.seed, step)
        count = self.batch_size * (self.seq_len - 2)
        words = torch.multinomial(self.weights, count, replacement=True, generator=generator) + FIRST_WORD
        inputs, labels = mask_tokens(_frame(words.view(self.batch_size, -1)), self.vocab_size, generator)
        return {"input_ids": inputs, "labels": labels}

    def state(self) -> dict:
        return {}


def read_lines(path: str | Path) -> list[str]:
    """Non-blank lines of a UTF-8 text file. Raises FileNotFoundError / ValueError with the path."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"--data {path}: no such file")
    lines = [line for line in path.read_text(encoding="utf-8", errors="replace").splitlines() if line.strip()]
    if not lines:
        raise ValueError(f"--data {path}: the file holds no text (empty or only whitespace)")
    return lines


def train_wordpiece(lines: list[str], vocab_size: int = BERT_VOCAB_SIZE):
    """A BERT-style (lower-cased) WordPiece tokenizer trained locally on ``lines``; no hub access.
    Small files give a vocabulary smaller than ``vocab_size``."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.WordPiece(unk_token=SPECIAL_TOKENS[UNK]))
    tokenizer.normalizer = normalizers.BertNormalizer(lowercase=True)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    trainer = trainers.WordPieceTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                        show_progress=False)
    tokenizer.train_from_iterator(lines, trainer=trainer)
    return tokenizer


class TextTokens:
    """Windows of a local text file: lines are tokenized and concatenated into one stream; each
    row of a batch is a window of seq_len - 2 words from a random start (wrapping around, so a
    short file still fills any length), framed by [CLS] ... [SEP].

    ``tokenizer_json`` (from ``state()``, kept in checkpoints) reuses a tokenizer instead of
    training one, so a resumed run keeps its vocabulary.
    """

    def __init__(self, path: str | Path, batch_size: int, seq_len: int, seed: int,
                 tokenizer_json: str | None = None):
        from tokenizers import Tokenizer

        lines = read_lines(path)
        tokenizer = Tokenizer.from_str(tokenizer_json) if tokenizer_json else train_wordpiece(lines)
        for token_id, token in enumerate(SPECIAL_TOKENS):
            if tokenizer.token_to_id(token) != token_id:
                raise ValueError(f"tokenizer: {token} must have id {token_id}, has {tokenizer.token_to_id(token)}")
        ids = [i for encoding in tokenizer.encode_batch(lines, add_special_tokens=False) for i in encoding.ids]
        if not ids:
            raise ValueError(f"--data {path}: no tokens after tokenization")
        self.batch_size, self.seq_len, self.seed = batch_size, seq_len, seed
        self.tokenizer, self.stream = tokenizer, torch.tensor(ids, dtype=torch.int64)
        self.vocab_size = tokenizer.get_vocab_size()

    def batch(self, step: int) -> dict[str, torch.Tensor]:
        generator = _generator(self.seed, step)
        starts = torch.randint(0, len(self.stream), (self.batch_size, 1), generator=generator)
        positions = (starts + torch.arange(self.seq_len - 2)) % len(self.stream)
        inputs, labels = mask_tokens(_frame(self.stream[positions]), self.vocab_size, generator)
        return {"input_ids": inputs, "labels": labels}

    def state(self) -> dict:
        return {"tokenizer": self.tokenizer.to_str()}


def make_source(data: str | None, batch_size: int, seq_len: int, seed: int, state: dict | None = None):
    """Synthetic tokens without ``data``, else windows of that text file (``state`` from a checkpoint)."""
    if data is None:
        return SyntheticTokens(batch_size, seq_len, seed)
    return TextTokens(data, batch_size, seq_len, seed, (state or {}).get("tokenizer"))
