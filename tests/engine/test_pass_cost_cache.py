"""The stored pass-cost curve: reused under an equal key once its checked passes still cost what it says,
measured again when they moved or when asked to, and never read or written with the cache off."""

from __future__ import annotations

import pytest
import torch

from pie_runtime.engine import pass_cost_cache as cache
from pie_runtime.engine.pass_cost_cache import CurveKey, StoredCurve, cache_path, curve_key, pass_costs
from pie_runtime.store import Manifest

KEY = CurveKey(
    model="m",
    model_files="f" * 16,
    weights="int4",
    device="cpu: test",
    threads=2,
    max_rows=4,
    page_size=16,
    compiled=False,
    tensor_parallel=1,
    torch=torch.__version__,
)
CURVE = [10.0, 11.0, 12.0, 20.0]


@pytest.fixture
def timed(monkeypatch, tmp_path):
    """The passes' costs as the test sets them (``now``: what a check times; ``measured``: a full curve), and
    a count of full measurements; the store under a fresh PIE_HOME."""
    monkeypatch.setenv("PIE_HOME", str(tmp_path))
    state = {"now": [10.0, 20.0], "measured": list(CURVE), "full": 0}

    def measure(runner, num_pages, max_rows):
        state["full"] += 1
        return list(state["measured"])

    monkeypatch.setattr(cache, "measure_pass_costs", measure)
    monkeypatch.setattr(cache, "time_passes", lambda runner, pages, widths, repeats: list(state["now"]))
    return state


def test_a_stored_curve_is_reused_while_its_checked_passes_hold(timed):
    costs, how = pass_costs(None, 64, KEY)  # type: ignore[arg-type]  # the runner only reaches the patched timers
    assert (costs, how, timed["full"]) == (CURVE, "measured", 1)
    assert StoredCurve.model_validate_json(cache_path(KEY).read_text()).costs_ms == CURVE

    timed["measured"] = [99.0] * 4  # what a full measurement would give now; a reuse does not run one
    timed["now"] = [12.4, 15.1]  # within a quarter of 10 and 20
    costs, how = pass_costs(None, 64, KEY)  # type: ignore[arg-type]
    assert costs == CURVE and how.startswith("reused") and timed["full"] == 1


@pytest.mark.parametrize("now", [[13.0, 20.0], [10.0, 14.0]])
def test_a_moved_pass_measures_the_curve_again_and_stores_it(timed, now):
    pass_costs(None, 64, KEY)  # type: ignore[arg-type]
    timed["now"], timed["measured"] = now, [13.0, 13.0, 14.0, 14.0]
    costs, how = pass_costs(None, 64, KEY)  # type: ignore[arg-type]
    assert (costs, how, timed["full"]) == ([13.0, 13.0, 14.0, 14.0], "measured", 2)
    timed["now"] = [13.0, 14.0]
    assert pass_costs(None, 64, KEY)[0] == [13.0, 13.0, 14.0, 14.0] and timed["full"] == 2  # type: ignore[arg-type]


def test_another_key_refresh_and_off(timed):
    pass_costs(None, 64, KEY)  # type: ignore[arg-type]
    other = KEY.model_copy(update={"threads": 4})
    assert cache_path(other) != cache_path(KEY)
    pass_costs(None, 64, other)  # type: ignore[arg-type]
    assert timed["full"] == 2  # not the 2-thread curve
    pass_costs(None, 64, KEY, "refresh")  # type: ignore[arg-type]
    assert timed["full"] == 3
    cache_path(KEY).unlink()
    pass_costs(None, 64, KEY, "off")  # type: ignore[arg-type]
    assert timed["full"] == 4 and not cache_path(KEY).exists()
    with pytest.raises(ValueError, match="--pass-cost-cache is one of reuse, refresh, off"):
        pass_costs(None, 64, KEY, "sometimes")  # type: ignore[arg-type]


def test_an_unreadable_or_foreign_file_is_measured_over(timed):
    path = cache_path(KEY)
    path.parent.mkdir(parents=True)
    path.write_text("{not json")
    assert pass_costs(None, 64, KEY)[1] == "measured"  # type: ignore[arg-type]
    foreign = StoredCurve(key=KEY.model_copy(update={"weights": "bf16"}), costs_ms=CURVE, measured_at=0.0)
    path.write_text(foreign.model_dump_json())  # another key under this file name: not this curve
    assert pass_costs(None, 64, KEY)[1] == "measured" and timed["full"] == 2  # type: ignore[arg-type]


def test_the_key_names_the_weights_files_device_and_threads():
    manifest = Manifest.model_construct(name="m", files={"model.safetensors": "ab"})
    key = curve_key(manifest, "int4", torch.device("cpu"), 32, 16, False, 1)
    assert key.device.startswith("cpu: ") and key.threads == torch.get_num_threads()
    retrained = Manifest.model_construct(name="m", files={"model.safetensors": "cd"})
    assert curve_key(retrained, "int4", torch.device("cpu"), 32, 16, False, 1).model_files != key.model_files


def test_a_curve_measured_on_other_kernel_sources_is_not_reused(timed):
    """The key names the native kernels' build (variant and source digest): a curve stored by an engine on other
    kernel sources is measured again, though its checked passes might still hold."""
    pass_costs(None, 64, KEY.model_copy(update={"kernels": "avx512vnni-0000000000000000"}))  # type: ignore[arg-type]
    costs, how = pass_costs(None, 64, KEY.model_copy(update={"kernels": "avx512vnni-1111111111111111"}))  # type: ignore[arg-type]
    assert how == "measured" and timed["full"] == 2
