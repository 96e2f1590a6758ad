"""Wire framing, ZeroMQ channels, shared-memory (POSIX / CUDA IPC) arenas and NIXL."""
