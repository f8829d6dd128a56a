"""Scheduler backends behind one interface (see base.SchedulerBackend)."""
