"""Pipeline parallelism: cutting a model into stages, schedules, the SMP v1 step."""
