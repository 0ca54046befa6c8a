"""Peak bytes of the tensors a function allocates, from torch's own allocation events (CPU or CUDA).

tracemalloc does not see torch's allocator, and the process's resident size mixes in the heap's own
habits; torch's profiler records every tensor allocation and release, and its memory profile
(`_memory_profile`, the data behind `export_memory_timeline`) lists them in order.
"""

from __future__ import annotations

from typing import Any, Callable

from torch.profiler import ProfilerActivity, profile


def peak_tensor_bytes(fn: Callable[[], Any]) -> int:
    """The largest total size of live tensors while `fn` runs (tensors alive before it counted too)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=True) as prof:
        fn()
    live = peak = 0
    for _, action, _, size in prof._memory_profile().timeline:
        if action.name in ("PREEXISTING", "CREATE"):
            live += size
        elif action.name == "DESTROY":
            live -= size
        peak = max(peak, live)
    return peak
