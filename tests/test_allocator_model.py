"""benchmarks/cuda_allocator_model.py: the caching allocator's model places a recorded CUDA step as CUDA did."""

from __future__ import annotations

import gzip
import importlib.util
import json
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parent.parent / "benchmarks" / "cuda_allocator_model.py"
_SPEC = importlib.util.spec_from_file_location("cuda_allocator_model", _PATH)
model = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(model)


@pytest.fixture(scope="module")
def recorded():
    with gzip.open(model.REPLAY, "rt") as f:
        return json.load(f)


def test_every_recorded_allocation_lands_where_cuda_put_it_and_the_peaks_match(recorded):
    assert {c["klass"] for c in recorded["cases"]} == {"full", "lora_fp16_ckpt", "qlora_ckpt"}
    for case in recorded["cases"]:
        r = model.replay(case)
        assert r["allocations"] > 5000, case["klass"]
        assert r["same_address"] == r["allocations"], case["klass"]
        assert r["segments_made"]["model"] == r["segments_made"]["cuda"], case["klass"]
        assert r["peak_allocated"]["model"] == r["peak_allocated"]["cuda"], case["klass"]
        assert r["peak_requested"]["model"] == r["peak_requested"]["cuda"], case["klass"]


def test_a_whole_run_from_before_its_load_replays_as_cuda_ran_it_and_the_first_update_makes_the_whole_blocks():
    with gzip.open(model.HISTORY, "rt") as f:
        histories = {c["klass"]: c for c in json.load(f)["cases"]}
    for klass, case in histories.items():
        r = model.replay(case)
        assert r["allocations"] > 20000 and r["same_address"] == r["allocations"], klass
        assert r["peak_allocated"]["model"] == r["peak_allocated"]["cuda"], klass
    # full fine-tuning: steps 1 and 2 skipped their update (fp16 overflow); step 3's update made AdamW's state
    by_step = model.whole_blocks_by_step(histories["full"])
    assert by_step[1] == by_step[2] == by_step[3] < 2**20 and by_step[4] > 70 * 2**20, by_step


def test_a_rest_of_one_mib_or_less_is_handed_out_with_a_large_block_and_counted():
    a = model.CachingAllocator()
    first = a.malloc(9 * 2**20)  # a 20 MiB segment: the rest (11 MiB) is split off
    second = a.malloc(10 * 2**20 - 4096)  # takes the 11 MiB rest: 1 MiB + 4 KiB left, split off
    assert (first.size, second.size) == (9 * 2**20, 10 * 2**20 - 4096)
    a.free(first.ptr)
    third = a.malloc(9 * 2**20 - 2**20)  # best fit is the freed 9 MiB: 1 MiB left, not split
    assert third.ptr == first.ptr and third.size == 9 * 2**20
    assert a.allocated - a.requested == 2**20
    a.malloc(100)  # the small pool: its own 2 MiB segment, a 512-byte block
    assert a.segment_sizes == [20 * 2**20, 2 * 2**20] and a.requested == a.allocated - 2**20 - 412


def test_freed_neighbours_merge_into_one_block():
    a = model.CachingAllocator()
    blocks = [a.malloc(4 * 2**20) for _ in range(3)]
    for b in blocks:
        a.free(b.ptr)
    assert a.pools[False] == [(20 * 2**20, blocks[0].ptr)] and a.allocated == 0
