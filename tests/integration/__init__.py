"""Tests against real servers (Redis, Ceph RADOS Gateway) started by scripts/servers.sh."""
