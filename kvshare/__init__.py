"""kvshare: a multi-tenant, secure, shared prefix-KV-cache service for LLM serving.

This package holds the applications: the `kvshare` command line (`kvshare.cli`) and
its subcommands — the round-robin demo, the simulator, the benchmark, admin and stats.
They sit on top of the server (`cacheserver`), the agent (`replica_agent`), `policy`
and the shared ground layer (`kvcommon`); nothing below imports them.
"""

__version__ = "0.1.0"
