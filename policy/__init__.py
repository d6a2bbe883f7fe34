"""Every security decision in kvshare: identity, authorization, block naming, sealing.

`cacheserver/` and `replica_agent/` call into this package and never read credentials
or derive keys themselves. The server's single entry point is `AccessPolicy`:
`authenticate` once per RPC (in the server's interceptor), then `admit` for the
tenant and action the request names.
"""

from __future__ import annotations

from policy.access import AccessPolicy
from policy.identity import Action, Principal

__all__ = ["AccessPolicy", "Action", "Principal"]
