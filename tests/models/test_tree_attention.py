"""Tree windows in the forward context (docs/architecture.md, "Tree windows"): a row of a token tree attends
the committed rows and its own ancestors only, so its logits are exactly those the same row gets decoded
alone along its path — bit for bit in every batch-invariant format, also beside another sequence and when
the tree runs in two chunks."""

from __future__ import annotations

import pytest
import torch

from pie_runtime.models.context import ForwardContext, Segment, ancestor_mask
from pie_runtime.models.kv_cache import KVCache
from pie_runtime.models.weights import ACTIVATION_DTYPE
from pie_runtime.protocol.tree import ancestors, tree_depths
from tests.models.test_weights import PAGE, logits_of, prepared
from tests.models.tiny_models import TINY_VOCAB

#          0
#        / | \
#       1  2  3
#      /|     |
#     4 5     6
#     |
#     7
PARENTS = (-1, 0, 0, 0, 1, 1, 3, 4)


def test_ancestor_mask_is_each_row_and_its_ancestors():
    mask = ancestor_mask(PARENTS)
    for row in range(len(PARENTS)):
        assert torch.flatten(mask[row].nonzero()).tolist() == ancestors(PARENTS, row)


@pytest.mark.parametrize("fmt", ["bf16", "int4"])
def test_a_tree_row_equals_that_row_decoded_alone_along_its_path(fmt, tiny_store):
    store, _ = tiny_store
    model = prepared("tiny-llama", fmt, store)
    kv = KVCache(model.config, 24, PAGE, ACTIVATION_DTYPE[fmt])
    g = torch.Generator().manual_seed(7)
    prompt = torch.randint(0, TINY_VOCAB, (13,), generator=g).tolist()
    other = torch.randint(0, TINY_VOCAB, (22,), generator=g).tolist()
    tree_tokens = torch.randint(0, TINY_VOCAB, (len(PARENTS),), generator=g).tolist()
    tree_pages, path_pages, other_pages = [0, 1, 2, 3, 4, 5], [6, 7, 8, 9, 10, 11], [12, 13, 14, 15, 16, 17]
    logits_of(model, [Segment(tree_pages, 0, 13)], prompt, kv)
    logits_of(model, [Segment(path_pages, 0, 13)], prompt, kv)
    logits_of(model, [Segment(other_pages, 0, 21)], other[:21], kv)
    depths = tree_depths(PARENTS, len(PARENTS))
    positions = [13 + d for d in depths]

    def tree(segments: list[Segment], ids: list[int], pos: list[int]) -> torch.Tensor:
        ctx = ForwardContext.build(segments, PAGE, positions=pos)
        return model.logits(model.forward(model.embed(torch.tensor(ids)), ctx, kv))

    whole = tree([Segment(tree_pages, 13, 8, PARENTS, 13)], tree_tokens, positions)
    beside = tree(
        [Segment(other_pages, 21, 1), Segment(tree_pages, 13, 8, PARENTS, 13)],
        [other[21], *tree_tokens],
        [21, *positions],
    )[1:]
    first = tree([Segment(tree_pages, 13, 3, PARENTS, 13)], tree_tokens[:3], positions[:3])
    second = tree([Segment(tree_pages, 16, 5, PARENTS, 13)], tree_tokens[3:], positions[3:])
    chunked = torch.cat([first, second])
    for row in range(len(PARENTS)):
        path = ancestors(PARENTS, row)
        # the path decoded one row at a time in a working set of its own
        for i, r in enumerate(path):
            alone = logits_of(model, [Segment(path_pages, 13 + i, 1)], [tree_tokens[r]], kv)
        assert torch.equal(whole[row], alone[0]), f"row {row} (path {path})"
        assert torch.equal(beside[row], alone[0])
        assert torch.equal(chunked[row], alone[0])
