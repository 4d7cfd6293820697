"""The ORM-handler workload of benchmarks/connections.py: an application table and its job."""
