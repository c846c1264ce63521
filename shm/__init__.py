"""Shared memory between the node's processes on one host.

``segment`` (common header, futexes, create/attach/unlink), ``ready`` (the
ready set), ``state`` (the state buffer) and ``wake`` (the keeper's wake
semaphore). Layouts are in docs/shm.md and beside each module's structs.

Only the supervisor creates and unlinks; every other process attaches and
closes.
"""
