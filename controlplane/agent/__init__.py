"""The telemetry agent: scrape model servers' metrics into etcd under a lease (``scrape``).
Its command line, ``kvpilot agent``, is ``commands.agent``."""

from controlplane.agent.scrape import Agent, AgentConfig, Target

__all__ = ["Agent", "AgentConfig", "Target"]
