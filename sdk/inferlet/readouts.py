"""Readout kinds: what a ForwardPass returns at the rows it reads out."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Logits:
    """Raw logits (rows, vocab) float32; a mask sets disallowed tokens to -inf."""

    kind = "logits"


@dataclass(frozen=True)
class Argmax:
    """The greedy token of each row (ties go to the lowest id)."""

    kind = "argmax"


@dataclass(frozen=True)
class Distribution:
    """Probabilities (rows, vocab) after temperature, top-k, top-p and the mask."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    kind = "distribution"


@dataclass(frozen=True)
class Sample:
    """One token per row drawn from the filtered distribution; the same seed gives the same tokens."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    kind = "sample"


@dataclass(frozen=True)
class Hidden:
    """The final hidden state (after the last norm) of each row."""

    kind = "hidden"


@dataclass(frozen=True)
class MTP:
    """k chained multi-token-prediction drafts from each row; with_probs adds the draft distributions.
    at_accepted (greedy): drafts only from the row where greedy verification of the window stops (the
    longest prefix of rows whose argmax is the window's next token), -1 at the others; saves an MTP chain
    and an lm head per other row."""

    k: int = 1
    with_probs: bool = False
    at_accepted: bool = False
    kind = "mtp"


@dataclass(frozen=True)
class Eagle:
    """k chained drafts of the model's EAGLE head from each row (the target's feature at the row, its draft
    layer over the sequence so far); the result is shaped as MTP's: tokens (R, 1+k), column 0 the target's
    argmax. with_probs and at_accepted as for MTP."""

    k: int = 1
    with_probs: bool = False
    at_accepted: bool = False
    kind = "eagle"


@dataclass(frozen=True)
class AttentionScores:
    """The attention mass each KV row of the working set received from each read row: softmax probabilities
    summed over the query heads and the layers (``per_layer``: over the heads only). ``res.readouts[i].scores``
    is float32 (rows, keys), or (rows, layers, keys), keys the working set's rows up to the end of the window,
    indexed by row (after an eviction a row's index is not its position); a key a row does not attend (a later
    row) gets 0, and each layer's mass sums to the number of query heads. Costs nothing on passes that do not
    ask for it; a reply is bounded (``MAX_ATTENTION_BYTES``, else ``limit_exceeded``). Ranking rows by the mass
    they gather is how H2O, SnapKV and TOVA choose what to keep:

        res = await inferlet.ForwardPass(ws).embed([token]).readout([0], inferlet.AttentionScores()).submit()
        mass = res.readouts[0].scores[0]  # (ws.committed,): every row's, the new token's included
        heavy = np.argsort(-mass, kind="stable")[:64]  # the 64 heavy hitters
    """

    per_layer: bool = False
    kind = "attention"


# its wire ``kind`` names it
ReadoutSpec = Logits | Argmax | Distribution | Sample | Hidden | MTP | Eagle | AttentionScores


def to_wire(kind: ReadoutSpec) -> dict:
    fields = {k: v for k, v in kind.__dict__.items()}
    if "temperature" in fields:
        fields["temperature"] = float(fields["temperature"])
        fields["top_p"] = float(fields["top_p"])
    return {"kind": kind.kind, **fields}
