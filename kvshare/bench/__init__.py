"""`kvshare bench`: the data path of kvshare measured beside the peers a user would pick.

Every system (kvshare, a raw-TCP ceiling, Redis, LMCache's server) runs as its own
server process, driven by client processes, in interleaved rounds; figures are medians
over rounds and ratios are taken within a round, since absolute figures drift 2-3x
between runs on shared machines (docs/design.md §12).
"""
