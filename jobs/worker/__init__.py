"""The engine pipeline of a `batchworker` process.

The engine is loaded once per process and fed continuously: an RQ job (`run_shard`) claims
a shard, streams its lines into a bounded inbox and returns as soon as the last line is
handed in, so the worker takes the next shard while the engine still finishes this one's
slowest requests (`intake`). One dispatcher thread drains the engine's results and writes
each to its shard's parts (`dispatch`, into the shard's work state `work`; a JSON output
that does not parse is run once more: `retry`); the shard is recorded done when its last
result is written (`finish`). The shard's row, like every database call the worker makes
itself, goes through one retrying `db.ShardStore`; its parts are stored by
`part_storage`, a checkpoint at a time (`checkpointer`). A heartbeat thread keeps claimed
shards alive in the database and stops shards whose batch was cancelled or expired
(`heartbeat`); the periodic duties (reconciler, scratch sweep) have a thread of their own
(`periodic`), so a slow reconcile never delays a heartbeat.
The threads share one `state.WorkerState` (the engine, the inbox, the shards in flight);
`pipeline.Pipeline` composes them and owns the lifecycle.

Only ids cross threads and processes; the engine never sees a Django object.
"""
