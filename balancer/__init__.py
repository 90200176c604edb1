"""The fleet: worker registry, health, load signals and DP-rank choice."""

from balancer.fleet import Fleet
from balancer.settings import BalancerSettings
from balancer.worker import Load, Outcome, RankLoad, Role, Ticket, Worker, WorkerSpec

__all__ = [
    "BalancerSettings",
    "Fleet",
    "Load",
    "Outcome",
    "RankLoad",
    "Role",
    "Ticket",
    "Worker",
    "WorkerSpec",
]
