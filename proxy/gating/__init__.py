"""Admission: the gate (permits, queue, sessions), the circuit breaker, the route table and
the stop registry. No HTTP."""
