"""`kvshare demo`: round robin over real replica processes, with and without the store."""
