"""The capacity plan (docs/operations.md, "Capacity and deadlines"): `plan.py` the plan
itself (each running batch's work, its projected end, which batches go first, the workers
each model needs) and `fleet.py` what live workers report of themselves through Redis, the
plan's inputs besides the rows. Below the services and the read models, which both read it:
the reconciler's pass writes it on the batches' rows (jobs.services.deadlines, a state
change like every other) and `Batch.projection` (jobs.models) reads it back from a row."""
