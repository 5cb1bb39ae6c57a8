"""Workloads: build the list of requests (prompt token ids, sampling params, arrival offsets)."""

from lab.workloads.base import SamplingDefaults, Workload
from lab.workloads.datasets import DatasetWorkload
from lab.workloads.file import FileWorkload
from lab.workloads.random import RandomWorkload

__all__ = ["SamplingDefaults", "Workload", "DatasetWorkload", "FileWorkload", "RandomWorkload"]
