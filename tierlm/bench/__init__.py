"""`tierlm bench`: measure this machine's rates (NVMe, host memory, compute) for the planner."""
