"""Generated gRPC stubs for the kvshare.v1 wire contract (see proto/, scripts/gen_proto.py)."""
