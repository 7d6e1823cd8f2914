"""The memory meter against hand-built tensors of known size."""

from __future__ import annotations

import torch

from zeroedu.memory import PeakTracker, resident


def test_resident_counts_storages_once_per_category():
    a = torch.zeros(1000)               # 4000 bytes
    b = torch.zeros(10, dtype=torch.bfloat16)   # 20 bytes
    view = a[10:20]                     # shares a's storage
    got = resident({"parameters": [a, view], "gradients": [b, a], "buckets": [None], "other": []})
    assert got == {"parameters": 4000, "gradients": 20, "buckets": 0, "other": 0}


def test_peak_tracker_sees_allocations_and_frees():
    owned = {"parameters": [torch.zeros(256)]}     # 1024 bytes before the window
    phase = {"now": "forward"}
    with PeakTracker(lambda: owned, lambda: phase["now"]) as t:
        x = torch.ones(1000)                       # 4000 bytes, made in forward -> activations
        y = x * 2                                  # another 4000
        del x, y                                   # both freed
        phase["now"] = "backward"
        z = torch.ones(500, dtype=torch.float64)   # 4000 bytes, temporaries
        assert t.current() == 1024 + 4000
        del z
    assert t.peak_total == 1024 + 8000
    assert t.peak == {"parameters": 1024, "activations": 8000}
    assert t.peak_phase == "forward"


def test_peak_tracker_labels_engine_tensors_by_category():
    grads: list[torch.Tensor] = []
    owned = {"gradients": grads}
    with PeakTracker(lambda: owned, lambda: "backward") as t:
        g = torch.zeros(100)                       # made by an op, then handed to the engine
        grads.append(g)
        _ = torch.zeros(1)                         # a new peak makes the tracker relabel
    assert t.peak["gradients"] == 400
