"""Kernel entry points: typed Python wrappers over the `server._C` extension's ops."""
