"""Shared fixtures: free ports, subprocess servers on loopback, a private redis-server."""
