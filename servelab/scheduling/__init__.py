"""Scheduling: ``Request`` and its life cycle, ``SchedulerConfig``,
``Scheduler`` (one loop, no prefill/decode phases: ``num_computed_tokens``
catches up with ``num_tokens``), swappable policies (FCFS, priority,
shortest-prompt-first, fair share), ``SchedulerOutput`` and a trace-driven
simulator. (Not built yet: see the scheduler issue.)
"""
