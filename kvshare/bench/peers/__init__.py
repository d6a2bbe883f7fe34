"""The systems `kvshare bench` compares: each starts its own server and hands out clients."""
