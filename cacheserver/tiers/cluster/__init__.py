"""The shared tier on a Redis Cluster: several servers, one store.

With `[redis_cluster]` configured, every `kvshare serve` process that shares the same
tenants, principals and `secret_file` names a block the same way and finds it in the
cluster, whichever server wrote it; each keeps its memory tier and LMDB as a local
cache in front. docs/scale-out.md has the topology, sizing and fault behaviour.

Modules, in the order to read them:
- `config`: `[redis_cluster]`, parsed at start-up;
- `layout`: key names, the block header, the accounting scripts (the data model);
- `nodes`: the cluster client (the only module importing `redis`): per-node pipelines,
  nodes that failed are down for a while, failures are misses; `replies`: block values
  read straight off a node's socket;
- `accounting`: quotas and least-recently-used order across servers;
- `tier`: `ClusterTier`, what the store calls (a `cacheserver.tiers.SharedTier`);
  what it needs of this server's own copies comes in `start` (`LocalCopies`);
- `sharing`: writes to the cluster behind the ack, touches, local copies of reads;
- `deletes`, `follower`: deletes reaching every server, and the cluster's upkeep.

Nothing is imported here: `config` is read by every server, `redis` (the `cluster`
extra) only by one that names a cluster.
"""
