"""Small torch-only models for the model zoo bench (``bench/zoo.py``) and tests.

Every model is built by a module-level factory (no arguments, returns an ``nn.Module``)
and has a module-level ``<name>_batch(batch_size=8, seed=0)`` that makes a seeded
``(inputs, targets)`` pair. ``inputs`` is a tensor (``model(x)``), a tuple
(``model(*inputs)``) or a dict (``model(**inputs)``). Sizes are small: one forward and
backward at batch 8 takes a few milliseconds on a 2-core CPU.

:data:`ZOO_EXTRA` lists them all as ``name: Extra(factory, make_batch, expected, loss,
output)``: ``loss`` and ``output`` are what gradcheck's ``loss=`` and ``output=`` get
(``output`` None: gradcheck's automatic choice), ``expected`` the finding codes gradcheck
must give at world size 2 on a healthy machine.

What each model is for (and what gradcheck is expected to say):

- deterministic, single / DataParallel / DDP agree (``pass``, no finding):
  ``gru_classifier``, ``embeddingbag_classifier``, ``tied_lm``, ``buffer_mutating``,
  ``multi_input``, ``dict_input``, ``tuple_output``, ``dict_output``, ``hf_style_output``,
  and the explicit-``output=`` variants ``tuple_output_index`` and ``dict_output_key``;
- DDP needs ``find_unused_parameters`` (``unused-parameters``): ``conditionally_unused``;
- random draws in forward (``dropout-active``: controlled mode puts every draw's expected
  value in its place, and the strategies agree):

  - from dropout modules: ``transformer_lm`` (its ``nn.Dropout`` modules, but also
    ``nn.MultiheadAttention``'s functional attention dropout, which is not a module);
  - without any dropout module: ``lstm_classifier`` (``nn.LSTM(dropout=0.1)`` is a float
    applied functionally between layers), ``noise_injection`` (``randn_like``),
    ``random_masking`` (``rand`` + ``argsort``), ``functional_dropout``, ``rrelu_model``,
    ``mha_dropout``.

Kept free of gpudiag imports: ranks started as fresh interpreters get these classes by
value (``bench/zoo.py`` registers the module with cloudpickle).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

VOCAB = 100
SEQ_LEN = 16
NUM_CLASSES = 10
FEATURES = 16


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _labels(batch_size: int, g: torch.Generator, classes: int = NUM_CLASSES) -> torch.Tensor:
    return torch.randint(0, classes, (batch_size,), generator=g)


def _tokens(batch_size: int, seed: int) -> tuple[torch.Tensor, torch.Generator]:
    g = _gen(seed)
    return torch.randint(0, VOCAB, (batch_size, SEQ_LEN), generator=g), g


def _features(batch_size: int, seed: int) -> tuple[torch.Tensor, torch.Generator]:
    g = _gen(seed)
    return torch.randn(batch_size, FEATURES, generator=g), g


# -- language models and sequence classifiers -------------------------------------------------


class TransformerLM(nn.Module):
    """Token + learned position embeddings, a causal ``nn.TransformerEncoder`` (2 layers,
    d_model 64, 4 heads, dropout 0.1, batch_first) and a linear head.

    ``forward(tokens (B, T)) -> logits (B, V, T)``: class dimension second, so
    ``F.cross_entropy(logits, targets)`` takes next-token targets of shape ``(B, T)``."""

    def __init__(self, vocab: int = VOCAB, d_model: int = 64, nhead: int = 4, layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model)
        self.pos = nn.Parameter(torch.randn(SEQ_LEN, d_model) * 0.02)
        layer = nn.TransformerEncoderLayer(
            d_model, nhead, dim_feedforward=2 * d_model, dropout=0.1, batch_first=True
        )
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d_model, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        t = tokens.shape[1]
        h = self.embed(tokens) + self.pos[:t]
        mask = nn.Transformer.generate_square_subsequent_mask(t, device=tokens.device, dtype=h.dtype)
        h = self.encoder(h, mask=mask, is_causal=True)
        return self.head(h).transpose(1, 2)


def transformer_lm() -> nn.Module:
    return TransformerLM()


def transformer_lm_batch(batch_size: int = 8, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens (B, T) and next-token targets (B, T) (the tokens shifted by one)."""
    g = _gen(seed)
    seq = torch.randint(0, VOCAB, (batch_size, SEQ_LEN + 1), generator=g)
    return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()


class RNNClassifier(nn.Module):
    """Embedding, a recurrent network (batch_first) and a head on the last hidden state."""

    def __init__(self, cell: str, dropout: float, bidirectional: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 32)
        rnn = nn.LSTM if cell == "lstm" else nn.GRU
        self.rnn = rnn(32, 48, num_layers=2, dropout=dropout, batch_first=True, bidirectional=bidirectional)
        self.head = nn.Linear(48 * (2 if bidirectional else 1), NUM_CLASSES)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        _, state = self.rnn(self.embed(tokens))
        h = state[0] if isinstance(state, tuple) else state  # LSTM: (h_n, c_n)
        # h: (layers * directions, B, H): the last layer's state(s)
        last = h[-2:].transpose(0, 1).flatten(1) if self.rnn.bidirectional else h[-1]
        return self.head(last)


def lstm_classifier() -> nn.Module:
    """2-layer LSTM with dropout 0.1 between the layers (a float, applied functionally)."""
    return RNNClassifier("lstm", dropout=0.1)


def lstm_classifier_batch(batch_size: int = 8, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    tokens, g = _tokens(batch_size, seed)
    return tokens, _labels(batch_size, g)


def gru_classifier() -> nn.Module:
    """2-layer bidirectional GRU, no dropout: deterministic."""
    return RNNClassifier("gru", dropout=0.0, bidirectional=True)


def gru_classifier_batch(batch_size: int = 8, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    tokens, g = _tokens(batch_size, seed)
    return tokens, _labels(batch_size, g)


class EmbeddingBagClassifier(nn.Module):
    """``nn.EmbeddingBag(mode="mean")`` over fixed-length bags (2-D input (B, L)) + linear."""

    def __init__(self) -> None:
        super().__init__()
        self.bag = nn.EmbeddingBag(1000, 32, mode="mean")
        self.head = nn.Linear(32, NUM_CLASSES)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.bag(ids))


def embeddingbag_classifier() -> nn.Module:
    return EmbeddingBagClassifier()


def embeddingbag_classifier_batch(batch_size: int = 8, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = _gen(seed)
    ids = torch.randint(0, 1000, (batch_size, 12), generator=g)
    return ids, _labels(batch_size, g)


class TiedLM(nn.Module):
    """Embedding and output projection share one weight (``head.weight is embed.weight``).

    ``forward(tokens (B, T)) -> logits (B, V, T)``."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 32)
        self.mix = nn.Linear(32, 32)
        self.head = nn.Linear(32, VOCAB)
        self.head.weight = self.embed.weight  # tied

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.mix(self.embed(tokens)))
        return self.head(h).transpose(1, 2)


def tied_lm() -> nn.Module:
    return TiedLM()


def tied_lm_batch(batch_size: int = 8, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    return transformer_lm_batch(batch_size, seed)


# -- state and control flow -------------------------------------------------------------------


class BufferMutating(nn.Module):
    """Counts its training forwards and keeps a running mean of its hidden activations in
    registered buffers (updated in place, under no_grad, not BatchNorm); nothing it
    computes reads them, so the gradients do not depend on the buffers' state."""

    calls: torch.Tensor
    act_mean: torch.Tensor

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(FEATURES, 32)
        self.fc2 = nn.Linear(32, NUM_CLASSES)
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))
        self.register_buffer("act_mean", torch.zeros(32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.fc1(x))
        if self.training:
            with torch.no_grad():
                self.calls.add_(1)
                self.act_mean.mul_(0.9).add_(h.mean(0), alpha=0.1)
        return self.fc2(h)


def buffer_mutating() -> nn.Module:
    return BufferMutating()


def buffer_mutating_batch(batch_size: int = 8, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    x, g = _features(batch_size, seed)
    return x, _labels(batch_size, g)


#: ``ConditionallyUnused`` uses its outlier head only when some input exceeds this in magnitude.
OUTLIER = 100.0


class ConditionallyUnused(nn.Module):
    """A second head used only for batches with an outlier (some ``|x| > 100``): decided
    from the batch, the same way on every DDP shard of the seeded batch (whose values are
    clamped to ±4), so ``outlier_head`` gets no gradient and DDP needs
    ``find_unused_parameters``."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(FEATURES, 32)
        self.head = nn.Linear(32, NUM_CLASSES)
        self.outlier_head = nn.Linear(32, NUM_CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.body(x))
        out = self.head(h)
        if bool((x.abs() > OUTLIER).any()):
            out = out + self.outlier_head(h)
        return out


def conditionally_unused() -> nn.Module:
    return ConditionallyUnused()


def conditionally_unused_batch(batch_size: int = 8, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    x, g = _features(batch_size, seed)
    return x.clamp(-4, 4), _labels(batch_size, g)


# -- several inputs ---------------------------------------------------------------------------


class MultiInput(nn.Module):
    """``forward(image (B, 3, 16, 16), features (B, 16))``: a conv branch and an MLP branch,
    concatenated, then a head."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(2), nn.Flatten()
        )
        self.mlp = nn.Sequential(nn.Linear(FEATURES, 16), nn.ReLU())
        self.head = nn.Linear(8 * 4 + 16, NUM_CLASSES)

    def forward(self, image: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        return self.head(torch.cat([self.conv(image), self.mlp(features)], dim=1))


def multi_input() -> nn.Module:
    return MultiInput()


def multi_input_batch(
    batch_size: int = 8, seed: int = 0
) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
    g = _gen(seed)
    image = torch.randn(batch_size, 3, 16, 16, generator=g)
    features = torch.randn(batch_size, FEATURES, generator=g)
    return (image, features), _labels(batch_size, g)


class DictInput(nn.Module):
    """``forward(*, x (B, T, 16), mask (B, T) bool)``: a masked mean over positions."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(FEATURES, 32)
        self.head = nn.Linear(32, NUM_CLASSES)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self.proj(x))
        weights = mask.to(h.dtype).unsqueeze(-1)
        pooled = (h * weights).sum(1) / weights.sum(1).clamp_min(1.0)
        return self.head(pooled)


def dict_input() -> nn.Module:
    return DictInput()


def dict_input_batch(batch_size: int = 8, seed: int = 0) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """``{"x": (B, 12, 16) floats, "mask": (B, 12) bools}``: model(**inputs)."""
    g = _gen(seed)
    x = torch.randn(batch_size, 12, FEATURES, generator=g)
    lengths = torch.randint(1, 13, (batch_size,), generator=g)
    mask = torch.arange(12).unsqueeze(0) < lengths.unsqueeze(1)
    return {"x": x, "mask": mask}, _labels(batch_size, g)


# -- structured outputs -----------------------------------------------------------------------


class ModelOutput(OrderedDict):
    """A Hugging Face ``ModelOutput``-like result: an ordered dict whose keys are also
    attributes (``out.logits is out["logits"]``); None values are left out, as there."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        for key in [k for k, v in self.items() if v is None]:
            del self[key]

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None

    def to_tuple(self) -> tuple[Any, ...]:
        return tuple(self.values())


class _Backbone(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(FEATURES, 32), nn.Tanh())
        self.head = nn.Linear(32, NUM_CLASSES)


class TupleOutput(_Backbone):
    """``forward(x) -> (logits (B, 10), hidden (B, 32))``; the hidden part has no
    parameters of its own, so every parameter reaches the loss through the logits."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.body(x)
        return self.head(h), h


class DictOutput(_Backbone):
    """``forward(x) -> {"out": logits, "aux": hidden}``."""

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        h = self.body(x)
        return {"out": self.head(h), "aux": h}


class HFStyleOutput(_Backbone):
    """``forward(x) -> ModelOutput(logits=…, hidden_states=…)`` (``loss`` None: dropped)."""

    def forward(self, x: torch.Tensor) -> ModelOutput:
        h = self.body(x)
        return ModelOutput(loss=None, logits=self.head(h), hidden_states=h)


def tuple_output() -> nn.Module:
    return TupleOutput()


def dict_output() -> nn.Module:
    return DictOutput()


def hf_style_output() -> nn.Module:
    return HFStyleOutput()


def features_batch(batch_size: int = 8, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, 16) standard-normal features and class labels."""
    x, g = _features(batch_size, seed)
    return x, _labels(batch_size, g)


tuple_output_batch = dict_output_batch = hf_style_output_batch = features_batch


# -- random in forward, without dropout modules -----------------------------------------------


class NoiseInjection(nn.Module):
    """Adds ``randn_like(x) * 0.1`` to the hidden activations in training."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(FEATURES, 32)
        self.fc2 = nn.Linear(32, NUM_CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x)
        if self.training:
            h = h + torch.randn_like(h) * 0.1
        return self.fc2(F.relu(h))


def noise_injection() -> nn.Module:
    return NoiseInjection()


noise_injection_batch = features_batch


class RandomMasking(nn.Module):
    """MAE-style: embeds 16 tokens, keeps a random 12 of them per sample (``torch.rand``
    noise, ``argsort``, ``gather``) in training, mean-pools, classifies."""

    def __init__(self, keep: float = 0.75) -> None:
        super().__init__()
        self.keep = keep
        self.embed = nn.Linear(8, 32)
        self.head = nn.Linear(32, NUM_CLASSES)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)  # (B, N, D)
        if self.training:
            b, n, d = h.shape
            kept = int(n * self.keep)
            noise = torch.rand(b, n, device=h.device)
            ids = torch.argsort(noise, dim=1)[:, :kept]
            h = torch.gather(h, 1, ids.unsqueeze(-1).expand(b, kept, d))
        return self.head(h.mean(1))


def random_masking() -> nn.Module:
    return RandomMasking()


def random_masking_batch(batch_size: int = 8, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = _gen(seed)
    return torch.randn(batch_size, 16, 8, generator=g), _labels(batch_size, g)


class FunctionalDropout(nn.Module):
    """``F.dropout(h, 0.2, self.training)`` in forward: dropout with no module to find."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(FEATURES, 32)
        self.fc2 = nn.Linear(32, NUM_CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.dropout(F.relu(self.fc1(x)), 0.2, self.training))


def functional_dropout() -> nn.Module:
    return FunctionalDropout()


functional_dropout_batch = features_batch


def rrelu_model() -> nn.Module:
    """``nn.RReLU``: a random negative slope per element in training."""
    return nn.Sequential(nn.Linear(FEATURES, 32), nn.RReLU(), nn.Linear(32, NUM_CLASSES))


rrelu_model_batch = features_batch


class MHADropout(nn.Module):
    """Self-attention with ``nn.MultiheadAttention(dropout=0.1)`` (the dropout on the
    attention weights is functional, inside the module), mean-pooled, then a head."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 32)
        self.attn = nn.MultiheadAttention(32, 4, dropout=0.1, batch_first=True)
        self.head = nn.Linear(32, NUM_CLASSES)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.proj(tokens)
        h, _ = self.attn(h, h, h, need_weights=False)
        return self.head(h.mean(1))


def mha_dropout() -> nn.Module:
    return MHADropout()


mha_dropout_batch = random_masking_batch


# -- registry ---------------------------------------------------------------------------------

Factory = Callable[[], nn.Module]
MakeBatch = Callable[..., tuple[Any, torch.Tensor]]

#: Finding codes (gradcheck's warnings) a model gives on a healthy machine.
BATCHNORM = "batchnorm-per-replica"
DROPOUT = "dropout-active"
UNUSED = "unused-parameters"


@dataclass(frozen=True)
class Extra:
    """A zoo model: its factory, ``make_batch(batch_size=8, seed=0)``, gradcheck's
    ``loss=`` and ``output=``, and the finding codes (warnings and errors) gradcheck must
    give for it at world size 2 on a healthy machine (empty: verdict ``pass``)."""

    factory: Factory
    make_batch: MakeBatch
    expected: frozenset[str] = frozenset()
    loss: Any = "ce"
    output: int | str | None = None


_RANDOM = frozenset({DROPOUT})

#: name → :class:`Extra`. Every random draw in forward (dropout modules or functional,
#: attention and RNN-layer dropout, RReLU, noise, random masking) has an expected value
#: gradcheck's controlled mode puts in its place, so it is confirmed as ``dropout-active``.
ZOO_EXTRA: dict[str, Extra] = {
    "transformer_lm": Extra(transformer_lm, transformer_lm_batch, _RANDOM),
    "lstm_classifier": Extra(lstm_classifier, lstm_classifier_batch, _RANDOM),
    "gru_classifier": Extra(gru_classifier, gru_classifier_batch),
    "embeddingbag_classifier": Extra(embeddingbag_classifier, embeddingbag_classifier_batch),
    "tied_lm": Extra(tied_lm, tied_lm_batch),
    "buffer_mutating": Extra(buffer_mutating, buffer_mutating_batch),
    "conditionally_unused": Extra(conditionally_unused, conditionally_unused_batch, frozenset({UNUSED})),
    "multi_input": Extra(multi_input, multi_input_batch),
    "dict_input": Extra(dict_input, dict_input_batch),
    "tuple_output": Extra(tuple_output, tuple_output_batch),
    "tuple_output_index": Extra(tuple_output, tuple_output_batch, output=0),
    "dict_output": Extra(dict_output, dict_output_batch),
    "dict_output_key": Extra(dict_output, dict_output_batch, output="out"),
    "hf_style_output": Extra(hf_style_output, hf_style_output_batch),
    "noise_injection": Extra(noise_injection, noise_injection_batch, _RANDOM),
    "random_masking": Extra(random_masking, random_masking_batch, _RANDOM),
    "functional_dropout": Extra(functional_dropout, functional_dropout_batch, _RANDOM),
    "rrelu_model": Extra(rrelu_model, rrelu_model_batch, _RANDOM),
    "mha_dropout": Extra(mha_dropout, mha_dropout_batch, _RANDOM),
}
