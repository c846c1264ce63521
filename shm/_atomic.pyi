# Type stub for the C extension shm/_atomic.c and its parts (see their comments).
from typing import Any

# 1 in the test build (setup.py with QUEUE_NODE_TEST_STOPS=1), 0 otherwise.
TEST_STOPS: int
# The futex syscall's number on this machine (<sys/syscall.h>).
SYS_futex: int
# The offsets and codes it was built with (shm/layout.h; shm/layout.py checks them).
LEASE_LAYOUT: dict[str, int]
LEASE_STRUCTS: dict[str, int]
READY_LAYOUT: dict[str, int]
READY_STRUCTS: dict[str, int]

# On any buffer (a read-only mapping too); fences: docs/shm.md, "Memory ordering".
def acquire32(buffer: Any, off: int, /) -> int: ...
def acquire64(buffer: Any, off: int, /) -> int: ...
def release32(buffer: Any, off: int, value: int, /) -> None: ...
def seq_copy(buffer: Any, seq_off: int, off: int, n: int, /) -> tuple[int, bytes] | None: ...
def seq_write(buffer: Any, seq_off: int, off: int, data: Any, /) -> int: ...

class View:
    def __init__(self, buffer: Any) -> None: ...
    def load64(self, off: int, /) -> int: ...
    def store64(self, off: int, value: int, /) -> None: ...
    def cas64(self, off: int, expected: int, desired: int, /) -> int: ...
    def add64(self, off: int, delta: int, /) -> int: ...
    def load32(self, off: int, /) -> int: ...
    def check32(self, off: int, expected: int, /) -> bool: ...
    def check64(self, off: int, expected: int, /) -> bool: ...
    def begin32(self, off: int, value: int, /) -> None: ...
    def release32(self, off: int, value: int, /) -> None: ...
    def read_slot(
        self,
        state_off: int,
        slot_off: int,
        key_at: int,
        inline_key: int,
        blocks_off: int,
        block_size: int,
        long_blocks: int,
        copy_at: int,
        record_size: int,
        keyed_mask: int,
        retries: int,
        /,
    ) -> tuple[int, bytes, bytes] | None: ...
    def max32(self, off: int, value: int, /) -> int: ...
    def store32(self, off: int, value: int, /) -> None: ...
    def publish_counted(
        self, states_off: int, idx: int, own: int, new: int, shard_off: int, k: int, stop: int, /
    ) -> bool: ...
    def shard_counts(self, off: int, n: int, /) -> tuple[list[int], list[int]]: ...
    def find_hash(
        self,
        states_off: int,
        hashes_off: int,
        count: int,
        start: int,
        n: int,
        hash: int,
        code_mask: int,
        /,
    ) -> list[int]: ...
    def find_code(
        self, states_off: int, count: int, start: int, n: int, code_mask: int, /
    ) -> int: ...
    def find_u64(self, off: int, count: int, start: int, value: int, /) -> int: ...
    def scan_codes(
        self, states_off: int, count: int, code_mask: int, /
    ) -> list[tuple[int, int]]: ...
    def code_counts(self, states_off: int, count: int, updating_code: int, /) -> list[int]: ...
    def scan_f64(
        self,
        states_off: int,
        count: int,
        code_mask: int,
        base: int,
        stride: int,
        off0: int,
        off1: int,
        limit: float,
        above: bool,
        /,
    ) -> list[tuple[int, int]]: ...
    def excluded_keys(
        self,
        states_off: int,
        count: int,
        slots_off: int,
        slot_size: int,
        key_at: int,
        inline_key: int,
        held_off0: int,
        held_off1: int,
        blocks_off: int,
        block_size: int,
        long_blocks: int,
        now: float,
        always_mask: int,
        held_mask: int,
        retries: int,
        cache: list[str | None] | None,
        seen: bytearray | None = None,
        /,
    ) -> tuple[set[str], list[int]] | tuple[list[str], list[str], list[int]]: ...
    def write_entries(
        self, entries_off: int, heap_off: int, heap_size: int, n: int,
        keys: list[str], versions: list[int], dues: list[int], cids: list[int],
        ranks: list[float], /,
    ) -> tuple[int, int, bool]: ...
    def write_gathered(
        self, entries_off: int, heap_off: int, heap_size: int, n: int,
        keys: list[str | None], versions: Any, slots: Any, dues: Any, cids: Any, ranks: Any, /,
    ) -> tuple[int, int, bool, list[str]]: ...
    def release(self) -> None: ...
