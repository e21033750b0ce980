"""The continual experiment's measure against constructions whose answer is known: the documents hold the passage
twice where they say; a model that cannot remember (its prediction depends on the current byte alone) reads both
the same; an exact copier (an induction rule over the bytes already read) reads random bytes at 8 bits per byte the
first time and almost for free the second."""

import math

import pytest
import torch
from torch import nn

from titans.experiments.continual import passage_bits, passage_nats
from titans.tasks.lm import repeated_passage_documents

GRID = {"prefix": 24, "passage": 40, "documents": 6, "batch_size": 4, "piece": None}


class CurrentByte(nn.Module):
    """Logits from the current byte alone (a bigram table): no memory of anything before it."""

    def __init__(self):
        super().__init__()
        self.table = nn.Embedding(256, 256, dtype=torch.float64)

    def forward(self, tokens, state=None):
        return self.table(tokens), state


class Copier(nn.Module):
    """Predicts the byte that followed the latest earlier occurrence of the last `k` bytes, with logit `margin` on it
    (0 on the rest); uniform where those bytes never occurred before."""

    def __init__(self, k: int = 4, margin: float = 12.0):
        super().__init__()
        self.k, self.margin = k, margin
        self.anchor = nn.Parameter(torch.zeros(()))  # a parameter, so that callers can find the device

    def forward(self, tokens, state=None):
        logits = torch.zeros(*tokens.shape, 256, dtype=torch.float64)
        for row, sequence in enumerate(tokens.tolist()):
            text = bytes(sequence)
            for t in range(self.k - 1, len(text)):
                found = text.rfind(text[t - self.k + 1:t + 1], 0, t)
                if found >= 0:
                    logits[row, t, text[found + self.k]] = self.margin
        return logits, state


def test_documents_repeat_their_passage_after_the_gap():
    data = torch.arange(1000) % 251
    docs = repeated_passage_documents(data, 3, 24, 40, 100, torch.Generator().manual_seed(0))
    assert docs.shape == (3, 24 + 40 + 100 + 40) and docs.dtype == torch.int64
    assert torch.equal(docs[:, 24:64], docs[:, 164:204])
    assert ((docs[:, 1:164] - docs[:, :163]) % 251 == 1).all()  # up to the second reading: the corpus as it is
    with pytest.raises(ValueError, match="fewer than prefix"):
        repeated_passage_documents(data, 1, 500, 400, 200, torch.Generator())
    with pytest.raises(ValueError, match="passage must be at least 1"):
        repeated_passage_documents(data, 1, 5, 0, 5, torch.Generator())


def test_a_model_without_memory_reads_the_passage_the_same_twice():
    torch.manual_seed(0)
    data = torch.randint(0, 256, (5000,), dtype=torch.uint8)
    bits = passage_bits(CurrentByte(), data, GRID, gap=300)
    assert bits["first"] == pytest.approx(bits["second"], rel=1e-12) and bits["first"] > 1


def test_a_copier_reads_random_bytes_at_8_bits_then_almost_free():
    """Random bytes: no 4-byte string recurs by chance, so the first reading is uniform, 8 bits a byte. The second:
    the passage's bytes 1-3 follow a 4-byte context that still reaches into the gap (8 bits each); from byte 4 on the
    copier finds the first reading and pays log2(1 + 255 e^-12) bits."""
    torch.manual_seed(1)
    data = torch.randint(0, 256, (5000,), dtype=torch.uint8)
    bits = passage_bits(Copier(), data, GRID, gap=300)
    hit = math.log2(1 + 255 * math.exp(-12.0))
    passage = GRID["passage"]
    assert bits["first"] == pytest.approx(8.0, abs=1e-9)
    assert bits["second"] == pytest.approx((3 * 8.0 + (passage - 4) * hit) / (passage - 1), abs=1e-9)


def test_passage_losses_read_in_pieces_match_whole_documents():
    from titans import TitansConfig, TitansLM

    torch.manual_seed(0)
    model = TitansLM(TitansConfig(variant="lmm", dim=16, depth=1, heads=2, chunk_size=4)).double().eval()
    docs = repeated_passage_documents(torch.randint(0, 256, (400,), dtype=torch.uint8), 2, 8, 16, 20,
                                      torch.Generator().manual_seed(0))
    whole = passage_nats(model, docs, [8, 44], 16)
    pieces = passage_nats(model, docs, [8, 44], 16, piece=7)
    assert all(a.item() == pytest.approx(b.item(), rel=1e-9) for a, b in zip(whole, pieces))
