"""Profiling: labelled ranges for the step loop and a torch.profiler wrapper with analysis (conf/profiler/)."""

from lab.profiling.ranges import profile_range, set_ranges_enabled
from lab.profiling.torch_profiler import NullProfiler, TorchProfiler

__all__ = ["profile_range", "set_ranges_enabled", "NullProfiler", "TorchProfiler"]
