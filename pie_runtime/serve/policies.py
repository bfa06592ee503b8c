"""Serving-level speculation: the server's policy (``--draft-lookup NGRAM:K``, ``--draft-model NAME:K``,
``--draft-mtp K``, ``--draft-suffix K[:ROWS]`` with ``--suffix-index FILE``), the checks that refuse a policy
that cannot run before the HTTP listener binds, and the choice of inferlet and arguments for each request.

    no policy, no per-request speculation     → text-completion
    lookup / draft / mtp (policy or request)  → cacheback- / draft-model- / mtp-speculative-decoding
    suffix (policy or request)                → suffix-speculative-decoding: one cross-request store per
                                                host and model (``Model.shared``: every run of a host sends
                                                the same store arguments), started from --suffix-index
    response_format json_object / json_schema → constrained-speculative-decoding (its drafts: forced tokens
    or tools (a tool-call grammar, tools.py)    and lookup; draft length 0 when speculation is off)

A request's ``speculation: false`` turns speculation off; ``{"method", "k"}`` asks for a method the server
can run (lookup and suffix always; draft only with ``--draft-model``; mtp only when the model has an MTP head)
with ``k`` at most the server's limit for it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field

from ..drafters import DrafterRefused, check_draft, check_mtp
from ..store import ModelStore, StoreError, import_model
from .errors import invalid_request
from .suffix_policy import check_suffix_index, suffix_args

MAX_K = 16  # the most drafts a round may verify, for any method
MAX_NGRAM = 8
MAX_ROWS = 64  # suffix: the most nodes a draft tree may have
TEXT_COMPLETION = "text-completion"
INFERLETS = {
    "lookup": "cacheback-speculative-decoding",
    "draft": "draft-model-speculative-decoding",
    "mtp": "mtp-speculative-decoding",
    "suffix": "suffix-speculative-decoding",
}
CONSTRAINED = "constrained-speculative-decoding"


class PolicyRefused(Exception):
    """A policy that cannot run on this model: the message names the refusal."""


class Policy(BaseModel):
    method: Literal["lookup", "draft", "mtp", "suffix"]
    k: int = Field(ge=1, le=MAX_K)
    ngram: int = Field(default=3, ge=1, le=MAX_NGRAM)  # lookup: the longest n-gram matched
    draft_model: str | None = None  # draft: a model in the store
    tree_rows: int = Field(default=0, ge=0, le=MAX_ROWS)  # suffix: > 0 drafts token trees of up to this many nodes
    suffix_index: str | None = None  # suffix: the static index the hosts' stores start from (an absolute path)


class Capabilities(BaseModel):
    """What the served model can speculate with: what requests may ask for."""

    mtp_depth: int = 0
    draft_model: str | None = None
    draft_k: int = MAX_K


def parse_policy(
    lookup: str | None,
    draft_model: str | None,
    mtp: str | None,
    suffix: str | None = None,
    suffix_index: str | None = None,
) -> Policy | None:
    """The policy of the command line (the four flags exclude each other; --suffix-index goes with
    --draft-suffix); raises PolicyRefused."""
    named = (("lookup", lookup), ("draft", draft_model), ("mtp", mtp), ("suffix", suffix))
    given = [(n, v) for n, v in named if v is not None]
    if len(given) > 1:
        raise PolicyRefused("--draft-lookup, --draft-model, --draft-mtp and --draft-suffix exclude each other")
    if suffix_index is not None and suffix is None:
        raise PolicyRefused("--suffix-index FILE needs --draft-suffix K (the index starts the suffix drafter's store)")
    if not given:
        return None
    method, value = given[0]
    try:
        if method == "suffix":
            return _suffix_policy(value, suffix_index)
        if method == "mtp":
            return Policy(method="mtp", k=_in_range(value, "--draft-mtp K", MAX_K))
        head, sep, k = value.rpartition(":")
        if not sep or not head:
            flag = "--draft-lookup NGRAM:K" if method == "lookup" else "--draft-model NAME:K"
            raise PolicyRefused(f"{flag} expected, got {value!r}")
        if method == "lookup":
            return Policy(method="lookup", ngram=_in_range(head, "NGRAM", MAX_NGRAM), k=_in_range(k, "K", MAX_K))
        return Policy(method="draft", draft_model=head, k=_in_range(k, "K", MAX_K))
    except ValueError as e:  # pydantic's range errors
        raise PolicyRefused(f"speculation policy out of range: {_first_line(e)}") from e


def _suffix_policy(value: str, suffix_index: str | None) -> Policy:
    """``--draft-suffix K`` (chains of up to K drafts) or ``K:ROWS`` (token trees of up to ROWS nodes)."""
    k, sep, rows = value.partition(":")
    if not k or (sep and not rows):
        raise PolicyRefused(f"--draft-suffix K[:ROWS] expected, got {value!r}")
    tree_rows = _in_range(rows, "ROWS", MAX_ROWS) if sep else 0
    k_max = _in_range(k, "--draft-suffix K", MAX_K)
    return Policy(method="suffix", k=k_max, tree_rows=tree_rows, suffix_index=suffix_index)


def _in_range(text: str, what: str, most: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise PolicyRefused(f"{what} must be an integer, got {text!r}") from None
    if not 1 <= value <= most:
        raise PolicyRefused(f"{what}={value} is out of range 1..{most}")
    return value


def _first_line(e: Exception) -> str:
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    return " ".join(lines[1:3]) if len(lines) > 1 else (lines[0] if lines else type(e).__name__)


def check_policy(store: ModelStore, model: str, policy: Policy | None) -> Capabilities:
    """Everything a policy needs, checked from the store before anything starts: the draft model loads and
    fits the target (vocabulary, token ids, positions, digests), the model has an MTP head as deep as K.
    Returns what requests may ask for; raises PolicyRefused naming the refusal. A draft model given as a
    path is imported into the store first (``policy.draft_model`` becomes its store name)."""
    try:
        target = store.get(model)
        caps = Capabilities(mtp_depth=_mtp_depth(store, target))
        if policy is None:
            return caps
        if policy.method == "mtp":
            if caps.mtp_depth == 0:
                raise PolicyRefused(f"--draft-mtp: model {model!r} has no MTP head (attach one: pie drafter attach)")
            if policy.k > caps.mtp_depth:
                raise PolicyRefused(f"--draft-mtp {policy.k}: K is past the MTP head's depth {caps.mtp_depth}")
        elif policy.method == "draft":
            assert policy.draft_model is not None
            name = policy.draft_model
            if Path(name).expanduser().exists():
                name = import_model(str(Path(name).expanduser()), store=store, progress=False).manifest.name
                policy.draft_model = name
            check_draft(store, target, name)
            store.verify(name, use_cache=True)  # a draft that does not load: missing or corrupt files
            caps.draft_model, caps.draft_k = name, policy.k
        elif policy.method == "suffix" and policy.suffix_index is not None:
            try:
                policy.suffix_index = check_suffix_index(policy.suffix_index, target.config.vocab_size)
            except ValueError as e:
                raise PolicyRefused(str(e)) from e
    except PolicyRefused:
        raise
    except DrafterRefused as e:
        raise PolicyRefused(f"draft refused: {e}") from e
    except StoreError as e:
        raise PolicyRefused(f"{type(e).__name__}: {e}") from e
    return caps


def _mtp_depth(store: ModelStore, target) -> int:
    entry = next((d for d in target.drafters if d.kind == "mtp"), None)
    if entry is None:
        return 0
    return check_mtp(target, store.path(target.name) / entry.path).depth


def _max_k(method: str, policy: Policy | None, caps: Capabilities) -> int:
    if method == "mtp":
        return caps.mtp_depth
    if method == "draft":
        return caps.draft_k if caps.draft_model else 0
    return policy.k if policy is not None and policy.method == method else MAX_K


def choose(
    policy: Policy | None,
    caps: Capabilities,
    speculation: Literal[False] | Any | None,
    response_format: Any | None,
    grammar: str | None = None,
) -> tuple[str, dict[str, Any]]:
    """The inferlet for one request and the arguments its policy adds; raises a 400 for a request asking
    for speculation the server cannot run. ``grammar``: a Lark grammar the output is held to (tool calls)."""
    if grammar is not None:
        return CONSTRAINED, {"grammar": grammar, **({"draft_length": 0} if speculation is False else {})}
    fmt = getattr(response_format, "type", "text") if response_format is not None else "text"
    if fmt in ("json_object", "json_schema"):
        schema: dict[str, Any] = {"type": "object"}
        if fmt == "json_schema":
            spec = getattr(response_format, "json_schema", None)
            if spec is None or not spec.schema_:
                raise invalid_request("response_format json_schema needs a schema", param="response_format")
            schema = spec.schema_
            check_schema(schema)
        args: dict[str, Any] = {"json_schema": json.dumps(schema)}
        if speculation is False:
            args["draft_length"] = 0
        return CONSTRAINED, args
    if speculation is False:
        return TEXT_COMPLETION, {}
    if speculation is not None:
        method, k = speculation.method, speculation.k
        limit = _max_k(method, policy, caps)
        if limit == 0:
            why = "no MTP head" if method == "mtp" else "no --draft-model"
            raise invalid_request(f"speculation method {method!r} is not served here ({why})", param="speculation")
        if k > limit:
            raise invalid_request(f"speculation k={k} is past this server's limit {limit}", param="speculation.k")
        same = policy if policy is not None and policy.method == method else None
        chosen = Policy(
            method=method,
            k=k,
            ngram=policy.ngram if policy else 3,
            draft_model=caps.draft_model,
            tree_rows=same.tree_rows if same else 0,
            suffix_index=same.suffix_index if same else None,
        )
    elif policy is not None:
        chosen = policy
    else:
        return TEXT_COMPLETION, {}
    return INFERLETS[chosen.method], policy_args(chosen)


def check_schema(schema: dict[str, Any]) -> None:
    """A 400 for a schema that is not a valid JSON Schema (before any run starts)."""
    try:
        from jsonschema.exceptions import SchemaError
        from jsonschema.validators import validator_for
    except ImportError:  # optional here: without it the constrained inferlet refuses a bad schema itself
        return
    try:
        validator_for(schema).check_schema(schema)
    except SchemaError as e:
        raise invalid_request(f"invalid JSON schema: {e.message}", param="response_format") from e


def policy_args(policy: Policy) -> dict[str, Any]:
    """The inferlet arguments that carry a policy (read from each inferlet's Args)."""
    if policy.method == "lookup":
        return {"draft_length": policy.k, "max_ngram": policy.ngram}
    if policy.method == "draft":
        return {"draft": policy.draft_model, "draft_length": policy.k}
    if policy.method == "suffix":
        return suffix_args(policy.k, policy.tree_rows, policy.suffix_index)
    return {"draft_length": policy.k}
