"""Shim of ``skyrl/train/utils/utils.py``: ``get_free_port``, copied verbatim from NovaSky-AI/SkyRL at
commit a9564572eb8e91076be43c1bd5e4615e3de17265 (Apache-2.0) (see tests/upstream/README.md)."""

import socket


def get_free_port():
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.bind(("", 0))
    port = s.getsockname()[1]
    s.close()
    return port
