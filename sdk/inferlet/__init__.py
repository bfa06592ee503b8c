"""The inferlet SDK: write your own decode loop against a pie engine.

A whole inferlet, greedy decoding of ``--max-tokens`` tokens (``pie run FILE -- --prompt "Hello"``)::

    import inferlet


    @inferlet.main
    async def main(args: dict) -> str:
        model = inferlet.model()
        ws = model.working_set()
        ids = model.tokenizer.encode_prompt(args["prompt"])
        out: list[int] = []
        for _ in range(int(args.get("max_tokens", 8))):
            fp = inferlet.ForwardPass(ws).embed(ids)
            fp.readout([len(ids) - 1], inferlet.Argmax())  # the last row's argmax: the token after it
            res = await fp.submit()  # commits the rows it embedded
            ids = [int(res.tokens[0])]
            out += ids
        return model.tokenizer.decode(out)

The core is here (the model, working sets, ``ForwardPass``, readouts, programs, channels, errors and the
runtime); what a user does beyond one pass lives in subpackages, each with its own ``__all__``:
:mod:`inferlet.text` (completion arguments, sampling, streaming output, ``n`` choices, grammars),
:mod:`inferlet.spec` (speculative decoding: drafters, verification, token trees, draft planning) and
:mod:`inferlet.kv` (attention scores for eviction, saved KV). :mod:`inferlet.programs` holds the device
program tracer and its ops. The SDK reaches the engine only through the wire protocol; it never imports
engine or model code.
"""

from pie_runtime.protocol import ErrorCode, PieError

from .channels import Channel
from .errors import UsageError
from .forward import DEFERRED, ForwardPass, PassResult, ReadoutResult
from .kv_file import SavedKV, SavedKVMismatch
from .model import Model
from .programs import Program, trace
from .readouts import MTP, Argmax, AttentionScores, Distribution, Eagle, Hidden, Logits, Sample
from .runtime import connect, emit, main, model
from .tokenizer import StreamDecoder, Tokenizer
from .working_set import WorkingSet

__all__ = [
    "DEFERRED",
    "MTP",
    "Eagle",
    "Argmax",
    "Channel",
    "Distribution",
    "ErrorCode",
    "ForwardPass",
    "Hidden",
    "AttentionScores",
    "Logits",
    "Model",
    "PassResult",
    "PieError",
    "Program",
    "ReadoutResult",
    "Sample",
    "SavedKV",
    "SavedKVMismatch",
    "StreamDecoder",
    "Tokenizer",
    "UsageError",
    "WorkingSet",
    "connect",
    "emit",
    "main",
    "model",
    "trace",
]
