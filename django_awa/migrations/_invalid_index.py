"""What the migrations that build an index ``CONCURRENTLY`` run first.

A ``CREATE INDEX CONCURRENTLY`` interrupted (cancelled, a lost connection, a
deadlock, a duplicate in a unique index) leaves its index behind, marked
invalid: never used by a query, and for a unique one not enforced. Run
again, ``IF NOT EXISTS`` takes that index for built and the migration is
recorded as applied with it still invalid. So each build is preceded by
``drop_if_invalid(name)``: only after such an interruption is there anything
to drop; the drop takes the table's lock for a moment, under the same 5 s
limit as the other locks of the migrations.

Not a migration (the loader skips modules whose name starts with ``_``); its
text is what the migrations applied, so it does not change with later code.
"""


def drop_if_invalid(name: str) -> str:
    """SQL dropping index ``name`` if an interrupted build left it invalid; else nothing."""
    return (
        f"DO $$ BEGIN IF EXISTS (SELECT 1 FROM pg_index "
        f"WHERE indexrelid = to_regclass('{name}') AND NOT indisvalid) THEN "
        f"SET LOCAL lock_timeout = '5s'; DROP INDEX {name}; END IF; END $$"
    )
