"""Names on the command line -> the system objects that run them."""

from __future__ import annotations

from pathlib import Path

from kvshare.bench.config import BenchConfig
from kvshare.bench.peers.base import System
from kvshare.bench.peers.kvshare_peer import KvshareSystem
from kvshare.bench.peers.lmcache_peer import LmcacheSystem, find_lmcache_python
from kvshare.bench.peers.redis_peer import RedisSystem
from kvshare.bench.peers.tcp import TcpSystem


def build_system(name: str, lmcache_python: Path | None) -> System:
    match name:
        case "tcp":
            return TcpSystem()
        case "tcp-tls":
            return TcpSystem(tls=True)
        case "redis":
            return RedisSystem()
        case "redis-unix":
            return RedisSystem(unix=True)
        case "lmcache":
            return LmcacheSystem(lmcache_python)
        case "kvshare":
            return KvshareSystem()
        case "kvshare-tcp":
            return KvshareSystem(same_host=False)
        case "kvshare-tls":
            return KvshareSystem(tls=True)
        case "kvshare-sealed":
            return KvshareSystem(sealed=True)
        case "kvshare-tls-sealed":
            return KvshareSystem(tls=True, sealed=True)
        case "kvshare-nosync":
            return KvshareSystem(sync_writes=False)
        case "kvshare-grpc":
            return KvshareSystem(bulk=False)
    raise ValueError(f"unknown system {name!r}")


def build_systems(config: BenchConfig) -> list[System]:
    lmcache_python = find_lmcache_python(config.lmcache_python)
    return [build_system(name, lmcache_python) for name in config.systems]
