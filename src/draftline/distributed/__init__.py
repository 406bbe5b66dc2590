"""The job's machinery: joining, roles, health, failures, the run directory, memory."""
