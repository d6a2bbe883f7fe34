"""Names on the command line -> the system objects that run them."""

from __future__ import annotations

from pathlib import Path

from kvshare.bench.config import BenchConfig
from kvshare.bench.peers.base import System
from kvshare.bench.peers.cluster_peers import KvshareClusterSystem, RedisClusterSystem
from kvshare.bench.peers.kvshare_peer import KvshareSystem
from kvshare.bench.peers.lmcache_peer import LmcacheSystem, find_lmcache_python
from kvshare.bench.peers.redis_peer import RedisSystem
from kvshare.bench.peers.tcp import TcpSystem
from kvshare.bench.placement import LOOPBACK, Placement


def build_system(name: str, lmcache_python: Path | None, at: Placement = LOOPBACK) -> System:
    match name:
        case "tcp":
            return TcpSystem(placement=at)
        case "tcp-tls":
            return TcpSystem(tls=True, placement=at)
        case "redis":
            return RedisSystem(placement=at)
        case "redis-unix":
            return RedisSystem(unix=True, placement=at)
        case "lmcache":
            return LmcacheSystem(lmcache_python, placement=at)
        case "kvshare":
            return KvshareSystem(placement=at)
        case "kvshare-tcp":
            return KvshareSystem(same_host=False, placement=at)
        case "kvshare-tls":
            return KvshareSystem(tls=True, placement=at)
        case "kvshare-sealed":
            return KvshareSystem(sealed=True, placement=at)
        case "kvshare-tls-sealed":
            return KvshareSystem(tls=True, sealed=True, placement=at)
        case "kvshare-tcp-2w":
            return KvshareSystem(same_host=False, bulk_workers=2, placement=at)
        case "kvshare-tcp-4w":
            return KvshareSystem(same_host=False, bulk_workers=4, placement=at)
        case "kvshare-nosync":
            return KvshareSystem(sync_writes=False, placement=at)
        case "kvshare-grpc":
            return KvshareSystem(bulk=False, placement=at)
        case "redis-cluster":
            return RedisClusterSystem(placement=at)
        case "kvshare-cluster":
            return KvshareClusterSystem(placement=at)
        case "kvshare-cluster-warm":
            return KvshareClusterSystem(warm=True, placement=at)
    raise ValueError(f"unknown system {name!r}")


def build_systems(config: BenchConfig, at: Placement = LOOPBACK) -> list[System]:
    lmcache_python = find_lmcache_python(config.lmcache_python)
    return [build_system(name, lmcache_python, at) for name in config.systems]
