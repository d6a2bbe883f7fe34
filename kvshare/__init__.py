"""kvshare: a multi-tenant, secure, shared prefix-KV-cache service for LLM serving.

This small package holds what the server, the agent and the tools share: the
command line (`kvshare.cli`), the generated wire stubs (`kvshare.v1`), the
length-prefixed field encoding (`kvshare.encoding`) and the simulator.
"""

__version__ = "0.1.0"
