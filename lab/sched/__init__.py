"""Scheduling: which requests advance each step and by how many tokens."""

from lab.sched.output import SchedulerConfig, SchedulerOutput
from lab.sched.scheduler import Scheduler

__all__ = ["Scheduler", "SchedulerConfig", "SchedulerOutput"]
