"""The C modules' shared-memory layouts (shm/layout.h) against the Python
side's (shm/leases/, shm/ready/), through shm/layout.py."""

from __future__ import annotations

import pytest

from shm import layout
from shm.leases import protocol as leases  # where the lease table's layout is defined
from shm.ready import layout as ready  # where the ready set's layout is defined

C_MODULES = sorted(layout.built().items())


def test_the_c_modules_are_built():
    assert {name for name, _ in C_MODULES} == set(layout.MODULES)


@pytest.mark.parametrize(("name", "module"), C_MODULES)
def test_every_exported_lease_field_is_the_python_one(name, module):
    ours = layout.lease_side(vars(leases))
    exported = {**module.LEASE_LAYOUT, **module.LEASE_STRUCTS}
    assert {"SEALED", "SHARD_JOURNAL", "STATES", "SLOT_SIZE", "RECORD_SIZE", "COPY_AT_0",
            "LEASED", "SEQ_SHIFT", "RECORD.version", "KEY_META.block"} <= set(exported)  # fmt: skip
    for field, value in exported.items():
        assert field in ours, f"{name} exports {field}, which shm.leases does not name"
        assert ours[field] == value, field
    # the constants are shm.leases's own, by name (but for the three worked out)
    derived = {"RECORD_SIZE", "COPY_AT_0", "COPY_AT_1"}
    for field in set(module.LEASE_LAYOUT) - derived:
        assert getattr(leases, field) == module.LEASE_LAYOUT[field], field


@pytest.mark.parametrize(("name", "module"), C_MODULES)
def test_every_exported_ready_field_is_the_python_one(name, module):
    ours = layout.ready_side(vars(ready))
    exported = {**module.READY_LAYOUT, **module.READY_STRUCTS}
    assert {"FIRST_SLOT", "ENTRY_SIZE", "CLAIM_CURSOR", "CURSOR_INDEX", "SLOT.count",
            "ENTRY.version"} <= set(exported)  # fmt: skip
    for field, value in exported.items():
        assert field in ours, f"{name} exports {field}, which shm.ready does not name"
        assert ours[field] == value, field
    for field, value in module.READY_LAYOUT.items():
        assert getattr(ready, field) == value, field


def test_the_struct_fields_are_worked_out_from_the_python_structs():
    fields = layout.lease_side(vars(leases))
    assert fields["RECORD.lease_id"] == 0
    assert fields["RECORD.expires_at"] == leases.EXPIRES_AT
    assert fields["RECORD.held_until"] == leases.HELD_UNTIL
    assert fields["RECORD.consumer"] == 56  # after three u8 and a pad byte
    assert fields["RECORD.version"] == leases.RECORD.size - 8
    slots = layout.ready_side(vars(ready))
    assert slots["SLOT.generation"] == ready.SLOT_GENERATION
    assert slots["SLOT.claim_cursor"] == ready.CLAIM_CURSOR
    assert slots["ENTRY.rank"] == ready.ENTRY_SIZE - 8


def test_check_all_passes_on_this_build():
    layout.check_all()


def test_a_mismatched_layout_raises_import_error_naming_the_field():
    _, module = C_MODULES[0]
    moved = dict(module.LEASE_LAYOUT, SEALED=leases.SEALED + 4)
    with pytest.raises(ImportError, match="SEALED is 40 there, 36 here.*rebuild"):
        layout.check("shm._claim", moved, layout.lease_side(vars(leases)))
    moved = dict(module.READY_STRUCTS, **{"SLOT.count": 8})
    with pytest.raises(ImportError, match=r"SLOT\.count is 8 there, 4 here"):
        layout.check("shm._claim", moved, layout.ready_side(vars(ready)))
    with pytest.raises(ImportError, match="NOT_A_FIELD is 1 there, None here"):
        layout.check("shm._atomic", {"NOT_A_FIELD": 1}, vars(ready))


def test_the_check_runs_for_every_built_module(monkeypatch):
    """check_leases / check_ready look at each built module's dicts: a module
    built from another layout is refused by name."""
    name, module = C_MODULES[0]

    class Stale:
        LEASE_LAYOUT = dict(module.LEASE_LAYOUT, STATES=leases.STATES * 2)
        LEASE_STRUCTS = module.LEASE_STRUCTS
        READY_LAYOUT = module.READY_LAYOUT
        READY_STRUCTS = dict(module.READY_STRUCTS, **{"ENTRY.key_len": 6})

    monkeypatch.setattr(layout, "built", lambda: {name: Stale})
    with pytest.raises(ImportError, match=f"{name} was built from another layout.*STATES"):
        layout.check_leases(vars(leases))
    with pytest.raises(ImportError, match=r"ENTRY\.key_len is 6 there, 4 here"):
        layout.check_ready(vars(ready))
