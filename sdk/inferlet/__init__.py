"""The inferlet SDK: write your own decode loop against a pie engine.

    import inferlet

    @inferlet.main
    async def main(args):
        model = inferlet.model()
        ws = model.working_set()
        fp = inferlet.ForwardPass(ws)
        fp.embed(model.tokenizer.encode_prompt(args["prompt"]))
        fp.readout([0], inferlet.Argmax())
        res = await fp.submit()

The SDK reaches the engine only through the wire protocol; it never imports engine or model code.
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
