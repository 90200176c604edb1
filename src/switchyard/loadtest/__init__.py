"""Load tests: seeded workloads, an open-loop replay client, metrics, ceilings, comparisons."""
