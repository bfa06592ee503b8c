"""The C structs of the native decoder step (``kernels/native/step.c``, ``attention.h``) as ctypes sees them, and
the check that keeps them the same: the library reports each struct's size and each field's offset as its compiler
laid them out (``pie_struct_layout``), and :func:`check_layouts` compares those with these copies once a process,
so a field added, moved or retyped on one side only is an error at load, never a silent misread.
"""

from __future__ import annotations

import ctypes
import functools

_P = ctypes.c_void_p
_PP = ctypes.POINTER(ctypes.c_void_p)
_I32, _I64, _F32 = ctypes.c_int32, ctypes.c_int64, ctypes.c_float


class PassLayout(ctypes.Structure):
    """Where every row of a pass sits for one attention group of layers (its page tables, its window)."""

    _fields_ = [
        ("row_seg", _P),
        ("row_limit", _P),
        ("row_extra", _P),
        ("extras", _P),
        ("seg_pages", _P),
        ("pages", _P),
        ("write_slots", _P),
        ("row_skip", _P),
        ("page_size", _I32),
        ("max_keys", _I32),
    ]


class PieLayer(ctypes.Structure):
    """One layer's recipe beside its matmuls: norms, activation, rope table, attention group."""

    _fields_ = [
        ("attn_norm", _P),
        ("attn_post_norm", _P),
        ("ff_norm", _P),
        ("ff_post_norm", _P),
        ("q_norm", _P),
        ("k_norm", _P),
        ("kv_slots", _I64),
        ("act", _I32),
        ("rope", _I32),
        ("layout", _I32),
        ("pad", _I32),
    ]


class PieModel(ctypes.Structure):
    _fields_ = [
        ("layers", _I32),
        ("hidden", _I32),
        ("heads", _I32),
        ("kv_heads", _I32),
        ("head_dim", _I32),
        ("inter", _I32),
        ("kv_bf16", _I32),
        ("n_ropes", _I32),
        ("eps", _F32),
        ("attn_scalar", _F32),
        ("w", _PP * 4),
        ("kinds", _P),
        ("qkv_bias", _PP),
        ("o_bias", _PP),
        ("layer", _P),
        ("final_norm", _P),
        ("inv_freq", _P),
        ("k_cache", _PP),
        ("v_cache", _PP),
    ]


class PiePass(ctypes.Structure):
    _fields_ = [
        ("n_rows", _I64),
        ("x", _P),
        ("out", _P),
        ("positions", _P),
        ("layouts", _P),
        ("n_layouts", _I64),
        ("n_scores", _I64),
        ("score_rows", _P),
        ("score_at", _P),
        ("score_width", _P),
        ("score_layered", _P),
        ("scores", _P),
    ]


STRUCTS: tuple[type[ctypes.Structure], ...] = (PassLayout, PieLayer, PieModel, PiePass)
ACTIVATIONS = {"silu": 0, "gelu_pytorch_tanh": 1}  # step.c's ACT_SILU, ACT_GELU_TANH


class StructMismatch(RuntimeError):
    """A ctypes copy of a C struct differs from the library's layout."""


def c_layout(lib: ctypes.CDLL) -> dict[str, int]:
    """The library's table: ``"Struct"`` → its size, ``"Struct.field"`` → the field's offset."""
    out: dict[str, int] = {}
    name = ctypes.c_char_p()
    i = 0
    while (at := lib.pie_struct_layout(i, ctypes.byref(name))) >= 0:
        assert name.value is not None
        out[name.value.decode()] = at
        i += 1
    return out


def py_layout(structs: tuple[type[ctypes.Structure], ...] = STRUCTS) -> dict[str, int]:
    """The same table for the ctypes copies."""
    out: dict[str, int] = {}
    for s in structs:
        out[s.__name__] = ctypes.sizeof(s)
        for field in s._fields_:
            out[f"{s.__name__}.{field[0]}"] = getattr(s, field[0]).offset
    return out


def compare(c: dict[str, int], py: dict[str, int]) -> list[str]:
    """What differs between the two tables, one line each (empty: they agree)."""
    lines = [f"{k}: C {c.get(k)}, ctypes {py.get(k)}" for k in sorted(c.keys() | py.keys()) if c.get(k) != py.get(k)]
    return lines


@functools.cache
def check_layouts(lib: ctypes.CDLL) -> None:
    """Raises :class:`StructMismatch` naming every size and offset where the copies differ from ``lib``'s."""
    lines = compare(c_layout(lib), py_layout())
    if lines:
        raise StructMismatch("the native step's structs differ from their ctypes copies: " + "; ".join(lines))
