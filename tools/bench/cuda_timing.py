"""Timing shared by the PyTorch peers of `dz bench`: median of CUDA-event times, L2 flushed before each call."""
import json
import statistics

import torch


def timed(fn, reps, flush):
    """Median ms of fn() over reps calls after two warm-up calls; flush (a large tensor) is zeroed before each."""
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for _ in range(2):
        fn()
    for a, b in ev:
        flush.zero_()
        a.record()
        fn()
        b.record()
    torch.cuda.synchronize()
    return statistics.median(a.elapsed_time(b) for a, b in ev)


def peer_setup(dz_json):
    """dayzero's results (`dz bench ... --out FILE`), the CUDA device, a 256 MiB tensor to flush the L2 with (for
    timed) and a generator seeded 0 on the device."""
    dz = json.load(open(dz_json))
    dev = torch.device("cuda")
    flush = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
    g = torch.Generator(device=dev)
    g.manual_seed(0)
    return dz, dev, flush, g


def peer_write(path, bench, results):
    """A peer's results as JSON: its name, the PyTorch version and device, one row per dayzero row."""
    with open(path, "w") as f:
        json.dump({"bench": bench, "torch": torch.__version__, "device": torch.cuda.get_device_name(),
                   "results": results}, f, indent=1)
