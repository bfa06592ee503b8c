"""The KV cache as data: reach for ``inferlet.kv`` when an inferlet keeps, drops or stores what the model has
read, rather than only appending to it.

- :class:`AttentionScores`: a readout of how much attention each cached row received, the signal eviction
  policies (H2O's heavy hitters) rank rows by; ``WorkingSet.evict`` then removes rows (StreamingLLM keeps the
  first few and a recent window).
- :class:`SavedKV` (``WorkingSet.save``, ``Model.load_working_set``): a working set's rows written to a file
  and read back, for a prompt cache that outlives the process; :class:`SavedKVMismatch` when the file is
  another model's.
- :data:`CACHE_SALT`: the prefix-cache salt of the working sets a run opens (set per tenant by ``pie serve``),
  for an inferlet that shares state across runs and must keep tenants apart.

    from inferlet.kv import AttentionScores, SavedKV
"""

from __future__ import annotations

from ..kv_file import SavedKV, SavedKVMismatch
from ..readouts import AttentionScores
from ..working_set import CACHE_SALT

__all__ = ["AttentionScores", "SavedKV", "SavedKVMismatch", "CACHE_SALT"]
